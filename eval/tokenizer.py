"""SmolLM2's tokenizer and chat template, built from the GGUF metadata.

The GGUF says tokenizer.ggml.model = "gpt2" (byte-level BPE) and
tokenizer.ggml.pre = "smollm": llama.cpp splits every digit on its own, then
applies GPT-2's regex (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM). The same
pipeline in the ``tokenizers`` package is Digits(individual_digits) then
ByteLevel without a prefix space. Token ids were checked against llama.cpp
(see docs/EVAL.md). No BOS is added (tokenizer.ggml.add_bos_token = false);
tokens of type CONTROL (3) are special tokens and are matched in text, so
"<|im_start|>" in a string becomes one id.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3


class SmolTokenizer:
    def __init__(self, reader):
        def meta(key):
            return reader.fields[key].contents()

        if meta("tokenizer.ggml.model") != "gpt2" or meta("tokenizer.ggml.pre") != "smollm":
            raise ValueError("expected a gpt2/smollm tokenizer")
        tokens = meta("tokenizer.ggml.tokens")
        types = meta("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
        self.tok = tok
        self.eos = meta("tokenizer.ggml.eos_token_id")
        self.chat_template = meta("tokenizer.chat_template")

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def chat(self, user, system=None):
        """The GGUF's chat template for one user turn plus the assistant header.

        Hand-written to avoid a Jinja dependency; test_eval.py renders the GGUF's
        template with jinja2 (when installed) and compares.
        """
        if system is None:
            system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
