/* bulk — bulk connections' byte format and seal; see bulk.h. */
#include "proto/bulk.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#include "proto/aegis.h"

struct kvbb_aead {
	uint32_t cipher;
	EVP_CIPHER_CTX *enc, *dec; /* AES-256-GCM */
	uint8_t key[KVB_AEGIS_KEY_LEN]; /* AEGIS */
};

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
	return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

void kvbb_hdr_put(uint8_t out[KVBB_HDR_LEN], const struct kvbb_hdr *h)
{
	put32(out, KVBB_MAGIC_RECORD);
	put32(out + 4, h->flags);
	put64(out + 8, h->request_id);
	put64(out + 16, h->total);
	put64(out + 24, h->offset);
	put32(out + 32, h->len);
	put32(out + 36, 0);
}

int kvbb_hdr_get(const uint8_t in[KVBB_HDR_LEN], struct kvbb_hdr *h)
{
	uint32_t flags = get32(in + 4);

	if (get32(in) != KVBB_MAGIC_RECORD || get32(in + 36) || flags & ~(KVBB_LAST | KVBB_ABORT) ||
	    get32(in + 32) > KVBB_RECORD_MAX ||
	    ((flags & KVBB_ABORT) && (flags != (KVBB_LAST | KVBB_ABORT) || get32(in + 32))))
		return -EPROTO;
	h->flags = flags;
	h->request_id = get64(in + 8);
	h->total = get64(in + 16);
	h->offset = get64(in + 24);
	h->len = get32(in + 32);
	return 0;
}

static enum kvb_aegis_variant variant_of(uint32_t cipher)
{
	return cipher == KVBP_AEAD_AEGIS128X2 ? KVB_AEGIS_128X2 : KVB_AEGIS_128L;
}

uint32_t kvbb_aeads(void)
{
	return (kvb_aegis_available(KVB_AEGIS_128L) ? 1u << KVBP_AEAD_AEGIS128L : 0) |
	       (kvb_aegis_available(KVB_AEGIS_128X2) ? 1u << KVBP_AEAD_AEGIS128X2 : 0);
}

uint32_t kvbb_aead_pick(uint32_t mask)
{
	if (mask & 1u << KVBP_AEAD_AEGIS128X2)
		return KVBP_AEAD_AEGIS128X2;
	if (mask & 1u << KVBP_AEAD_AEGIS128L)
		return KVBP_AEAD_AEGIS128L;
	return KVBP_AEAD_AES256GCM;
}

const char *kvbb_cipher_name(uint32_t cipher)
{
	return cipher == KVBP_AEAD_AEGIS128X2  ? "AEGIS-128X2"
	       : cipher == KVBP_AEAD_AEGIS128L ? "AEGIS-128L"
					       : "AES-256-GCM";
}

const char *kvbb_aead_name(const struct kvbb_aead *a)
{
	return kvbb_cipher_name(a->cipher);
}

int kvbb_aead_new(struct kvbb_aead **out, const uint8_t key[KVBP_BULK_KEY_LEN], uint32_t cipher)
{
	struct kvbb_aead *a;
	int rc = -ENOMEM;

	if (cipher > KVBP_AEAD_MAX ||
	    (cipher != KVBP_AEAD_AES256GCM && !(kvbb_aeads() & 1u << cipher)))
		return -ENOTSUP;
	a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->cipher = cipher;
	if (cipher != KVBP_AEAD_AES256GCM) {
		memcpy(a->key, key, sizeof(a->key));
		*out = a;
		return 0;
	}
	a->enc = EVP_CIPHER_CTX_new();
	a->dec = EVP_CIPHER_CTX_new();
	if (!a->enc || !a->dec)
		goto fail;
	rc = -ENOTSUP;
	/* Keyed once; each record sets only its nonce (12 bytes, GCM's default). */
	if (EVP_EncryptInit_ex(a->enc, EVP_aes_256_gcm(), NULL, key, NULL) != 1 ||
	    EVP_DecryptInit_ex(a->dec, EVP_aes_256_gcm(), NULL, key, NULL) != 1)
		goto fail;
	*out = a;
	return 0;
fail:
	kvbb_aead_free(&a);
	return rc;
}

void kvbb_aead_free(struct kvbb_aead **a)
{
	if (!a || !*a)
		return;
	EVP_CIPHER_CTX_free((*a)->enc); /* clears the key schedule */
	EVP_CIPHER_CTX_free((*a)->dec);
	OPENSSL_cleanse((*a)->key, sizeof((*a)->key));
	free(*a);
	*a = NULL;
}

/* GCM's 12 bytes; AEGIS's 16 end in four zero bytes. */
static void nonce_of(uint8_t iv[KVB_AEGIS_NONCE_LEN], uint64_t counter, uint32_t dir)
{
	put64(iv, counter);
	put32(iv + 8, dir);
	put32(iv + 12, 0);
}

int kvbb_seal(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, const struct iovec *iov, size_t n, uint8_t *out,
	      uint8_t tag[KVBB_TAG_LEN])
{
	uint8_t iv[KVB_AEGIS_NONCE_LEN];
	int len;

	nonce_of(iv, counter, dir);
	if (a->cipher != KVBP_AEAD_AES256GCM) {
		for (size_t i = 0; i < n; i++)
			if (iov[i].iov_len > KVBB_RECORD_MAX)
				return -EIO;
		return kvb_aegis_seal(variant_of(a->cipher), a->key, iv, ad, ad_len, iov, n, out,
				      tag) ? -EIO : 0;
	}
	if (EVP_EncryptInit_ex(a->enc, NULL, NULL, NULL, iv) != 1 ||
	    (ad_len && EVP_EncryptUpdate(a->enc, NULL, &len, ad, (int)ad_len) != 1))
		return -EIO;
	for (size_t i = 0; i < n; i++) {
		if (iov[i].iov_len > KVBB_RECORD_MAX ||
		    EVP_EncryptUpdate(a->enc, out, &len, iov[i].iov_base, (int)iov[i].iov_len) != 1)
			return -EIO;
		out += len;
	}
	if (EVP_EncryptFinal_ex(a->enc, out, &len) != 1 ||
	    EVP_CIPHER_CTX_ctrl(a->enc, EVP_CTRL_GCM_GET_TAG, KVBB_TAG_LEN, tag) != 1)
		return -EIO;
	return 0;
}

int kvbb_open(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, uint8_t *buf, size_t len, const uint8_t tag[KVBB_TAG_LEN])
{
	uint8_t iv[KVB_AEGIS_NONCE_LEN], t[KVBB_TAG_LEN];
	int l;

	if (len > KVBB_RECORD_MAX) {
		OPENSSL_cleanse(buf, len); /* (the one contract: refused means zeroed) */
		return -EBADMSG;
	}
	nonce_of(iv, counter, dir);
	if (a->cipher != KVBP_AEAD_AES256GCM)
		return kvb_aegis_open(variant_of(a->cipher), a->key, iv, ad, ad_len, buf, len, tag)
			       ? -EBADMSG : 0; /* (zeroes buf on failure itself) */
	memcpy(t, tag, sizeof(t));
	if (EVP_DecryptInit_ex(a->dec, NULL, NULL, NULL, iv) != 1 ||
	    (ad_len && EVP_DecryptUpdate(a->dec, NULL, &l, ad, (int)ad_len) != 1) ||
	    (len && EVP_DecryptUpdate(a->dec, buf, &l, buf, (int)len) != 1) ||
	    EVP_CIPHER_CTX_ctrl(a->dec, EVP_CTRL_GCM_SET_TAG, KVBB_TAG_LEN, t) != 1 ||
	    EVP_DecryptFinal_ex(a->dec, buf + len, &l) != 1) {
		/* GCM decrypts before the tag is checked: no unauthenticated plaintext may
		 * stay in the caller's buffer */
		OPENSSL_cleanse(buf, len);
		return -EBADMSG;
	}
	return 0;
}

void kvbb_iov_advance(struct iovec **iov, int *n, size_t done)
{
	while (*n > 0 && done >= (*iov)->iov_len) {
		done -= (*iov)->iov_len;
		(*iov)++;
		(*n)--;
	}
	if (*n > 0) {
		(*iov)->iov_base = (uint8_t *)(*iov)->iov_base + done;
		(*iov)->iov_len -= done;
	}
}

int kvbb_hello_put(uint8_t out[KVBB_HELLO_LEN], const uint8_t ticket[KVBP_BULK_TICKET_LEN],
		   struct kvbb_aead *a)
{
	put32(out, KVBB_MAGIC_HELLO);
	put32(out + 4, KVBB_VERSION);
	memcpy(out + 8, ticket, KVBP_BULK_TICKET_LEN);
	memset(out + 24, 0, KVBB_TAG_LEN);
	if (!a)
		return 0;
	return kvbb_seal(a, 0, KVBB_DIR_HELLO, out, 24, NULL, 0, NULL, out + 24);
}

int kvbb_hello_ticket(const uint8_t in[KVBB_HELLO_LEN], uint8_t ticket[KVBP_BULK_TICKET_LEN])
{
	if (get32(in) != KVBB_MAGIC_HELLO || get32(in + 4) != KVBB_VERSION)
		return -EPROTO;
	memcpy(ticket, in + 8, KVBP_BULK_TICKET_LEN);
	return 0;
}

int kvbb_hello_check(const uint8_t in[KVBB_HELLO_LEN], struct kvbb_aead *a)
{
	uint8_t none[1];

	return kvbb_open(a, 0, KVBB_DIR_HELLO, in, 24, none, 0, in + 24);
}

int kvbb_endpoint_host(const char *endpoint, char *host, size_t len)
{
	char *colon;

	if (strncmp(endpoint, "tcp://", 6) || (size_t)snprintf(host, len, "%s", endpoint + 6) >= len)
		return -EINVAL;
	colon = strrchr(host, ':');
	if (!colon)
		return -EINVAL;
	*colon = 0;
	if (host[0] == '[' && colon > host + 1 && colon[-1] == ']') {
		colon[-1] = 0;
		memmove(host, host + 1, strlen(host));
	}
	return 0;
}
