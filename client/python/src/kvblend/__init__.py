"""kvblend: Python client for kvblendd, the kvblend KV-cache daemon.

A thin ctypes binding over the C client library libkvblend (client/include/kvblend.h):
every call is one libkvblend call, so the C and Python clients never disagree.

libkvblend.so is found, in this order:

1. ``$KVBLEND_LIB``, the path of libkvblend.so (if set, only this is tried);
2. the copy that ``pip install ./client/python`` built and bundled (``kvblend/_libs/``);
3. the checkout's ``build/lib/libkvblend.so`` when the package runs from its source
   tree (``pip install -e client/python`` or ``src/`` on ``sys.path``);
4. ``ctypes.util.find_library("kvblend")``, then ``libkvblend.so.1`` and
   ``libkvblend.so`` on the dynamic loader's search path (where the .deb installs it).

KV tensors are NumPy arrays shaped ``[layers, 2, tokens, kv_heads, head_dim]`` (K, then
V) in the model's dtype: float16, float32, or bfloat16 as uint16 raw bits.

Examples
--------
>>> import numpy as np, kvblend
>>> with kvblend.Client("ipc:///run/kvblend/kvblend.sock") as c:
...     c.model_register(kvblend.Model("tiny", 2, 2, 64, dtype="f16"))
...     h = kvblend.chunk_hash([1, 2, 3])
...     c.put("tiny", h, np.zeros((2, 2, 3, 2, 64), np.float16))
...     kv = c.get("tiny", h)
"""

from ._lib import lib as _cdll
from .client import (
    Client,
    chunk_hash,
    default_endpoint,
    hash_hex,
    malloc_tune,
    scoped_chunk_hash,
)
from .errors import (
    BadArgument,
    BadShape,
    BadShm,
    BufferSize,
    Busy,
    Corrupt,
    DtypeMismatch,
    Full,
    Internal,
    KvblendError,
    Limit,
    ModelConflict,
    NotFound,
    ProtocolError,
    Timeout,
    TooLarge,
    Unavailable,
    UnknownModel,
    UnknownSession,
)
from .sessions import FuseSession, LandingSession, Layers
from .types import ChunkInfo, DeviceCache, Model, Segment

__version__ = "0.1.0"

#: Path libkvblend was loaded from.
library_path: str = _cdll.kvblend_path

__all__ = [
    "DeviceCache",
    "BadArgument",
    "BadShape",
    "BadShm",
    "BufferSize",
    "Busy",
    "ChunkInfo",
    "Client",
    "Corrupt",
    "DtypeMismatch",
    "Full",
    "FuseSession",
    "Internal",
    "KvblendError",
    "LandingSession",
    "Layers",
    "Limit",
    "Model",
    "ModelConflict",
    "NotFound",
    "ProtocolError",
    "Segment",
    "Timeout",
    "TooLarge",
    "Unavailable",
    "UnknownModel",
    "UnknownSession",
    "chunk_hash",
    "default_endpoint",
    "hash_hex",
    "library_path",
    "malloc_tune",
    "scoped_chunk_hash",
]
