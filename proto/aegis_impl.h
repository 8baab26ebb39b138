/*
 * aegis_impl.h — the body of AEGIS-128L and AEGIS-128X2, included by aegis.c once per
 * vector width (the specification's AEGIS-128X of degree D runs D AEGIS-128L states side
 * by side, one per 128-bit lane, each with its own context; D = 1 is AEGIS-128L). Before
 * including it, aegis.c defines:
 *   VEC, BLOCK (bytes per update: 32 * D), TARGET, NAME(x) (x with the variant's suffix),
 *   V_LOAD(p), V_STORE(p, v), V_XOR, V_AND, V_AESENC (one AES round of each lane),
 *   V_BCAST(p) (a 16-byte value in every lane), V_CTX (the lanes' contexts: lane i holds
 *   Byte(i) || Byte(D - 1), zero-padded), V_FOLD(v) (the XOR of v's lanes, 16 bytes).
 * Not a header of its own: nothing outside aegis.c includes it.
 */

struct NAME(state) {
	VEC s0, s1, s2, s3, s4, s5, s6, s7;
};

/*
 * Update(M0, M1): S'i = AESRound(S(i-1), Si), with M0 into S0's round key, M1 into S4's.
 * The round key is XORed last, so AESRound(S7, S0 ^ M0) = AESRound(S7, S0) ^ M0: the AES
 * rounds start as soon as the state is there, while M0 and M1 (in decryption, the
 * keystream's XOR with the ciphertext) are still being computed.
 */
static inline TARGET void NAME(update)(struct NAME(state) *s, VEC m0, VEC m1)
{
	VEC t = s->s7;

	s->s7 = V_AESENC(s->s6, s->s7);
	s->s6 = V_AESENC(s->s5, s->s6);
	s->s5 = V_AESENC(s->s4, s->s5);
	s->s4 = V_XOR(V_AESENC(s->s3, s->s4), m1);
	s->s3 = V_AESENC(s->s2, s->s3);
	s->s2 = V_AESENC(s->s1, s->s2);
	s->s1 = V_AESENC(s->s0, s->s1);
	s->s0 = V_XOR(V_AESENC(t, s->s0), m0);
}

static inline TARGET void NAME(init)(struct NAME(state) *s, const uint8_t *key,
				     const uint8_t *nonce)
{
	VEC k = V_BCAST(key), n = V_BCAST(nonce), c0 = V_BCAST(c0_bytes), c1 = V_BCAST(c1_bytes);
	VEC ctx = V_CTX;

	s->s0 = V_XOR(k, n);
	s->s1 = c1;
	s->s2 = c0;
	s->s3 = c1;
	s->s4 = V_XOR(k, n);
	s->s5 = V_XOR(k, c0);
	s->s6 = V_XOR(k, c1);
	s->s7 = V_XOR(k, c0);
	for (int i = 0; i < 10; i++) {
		s->s3 = V_XOR(s->s3, ctx);
		s->s7 = V_XOR(s->s7, ctx);
		NAME(update)(s, n, k);
	}
}

/* The associated data, zero-padded to whole blocks. */
static inline TARGET void NAME(absorb)(struct NAME(state) *s, const uint8_t *ad, size_t len)
{
	uint8_t pad[BLOCK];

	for (; len >= BLOCK; ad += BLOCK, len -= BLOCK)
		NAME(update)(s, V_LOAD(ad), V_LOAD(ad + BLOCK / 2));
	if (len) {
		memset(pad, 0, sizeof(pad));
		memcpy(pad, ad, len);
		NAME(update)(s, V_LOAD(pad), V_LOAD(pad + BLOCK / 2));
	}
}

/* The keystream of the next block: z0 = S6 ^ S1 ^ (S2 & S3), z1 = S2 ^ S5 ^ (S6 & S7). */
static inline TARGET VEC NAME(z0)(const struct NAME(state) *s)
{
	return V_XOR(V_XOR(s->s6, s->s1), V_AND(s->s2, s->s3));
}

static inline TARGET VEC NAME(z1)(const struct NAME(state) *s)
{
	return V_XOR(V_XOR(s->s2, s->s5), V_AND(s->s6, s->s7));
}

static inline TARGET void NAME(enc)(struct NAME(state) *s, const uint8_t *in, uint8_t *out)
{
	VEC t0 = V_LOAD(in), t1 = V_LOAD(in + BLOCK / 2);

	V_STORE(out, V_XOR(t0, NAME(z0)(s)));
	V_STORE(out + BLOCK / 2, V_XOR(t1, NAME(z1)(s)));
	NAME(update)(s, t0, t1);
}

static inline TARGET void NAME(dec)(struct NAME(state) *s, uint8_t *buf)
{
	VEC o0 = V_XOR(V_LOAD(buf), NAME(z0)(s)), o1 = V_XOR(V_LOAD(buf + BLOCK / 2), NAME(z1)(s));

	V_STORE(buf, o0);
	V_STORE(buf + BLOCK / 2, o1);
	NAME(update)(s, o0, o1);
}

/* Finalize: seven updates with S2 ^ (LE64(ad bits) || LE64(msg bits)) in every lane; the
 * tag is S0 ^ ... ^ S6, its lanes XORed together. */
static inline TARGET __m128i NAME(finalize)(struct NAME(state) *s, size_t ad_len, size_t msg_len)
{
	uint8_t u[16];
	VEC t;

	for (int i = 0; i < 8; i++) {
		u[i] = (uint8_t)(((uint64_t)ad_len << 3) >> (8 * i));
		u[8 + i] = (uint8_t)(((uint64_t)msg_len << 3) >> (8 * i));
	}
	t = V_XOR(s->s2, V_BCAST(u));
	for (int i = 0; i < 7; i++)
		NAME(update)(s, t, t);
	return V_FOLD(V_XOR(V_XOR(V_XOR(s->s0, s->s1), V_XOR(s->s2, s->s3)),
			    V_XOR(V_XOR(s->s4, s->s5), s->s6)));
}

static TARGET void NAME(seal)(const uint8_t *key, const uint8_t *nonce, const uint8_t *ad,
			      size_t ad_len, const struct iovec *iov, size_t n, uint8_t *out,
			      uint8_t *tag)
{
	struct NAME(state) s;
	uint8_t carry[BLOCK];
	size_t held = 0, total = 0;

	NAME(init)(&s, key, nonce);
	NAME(absorb)(&s, ad, ad_len);
	for (size_t i = 0; i < n; i++) {
		const uint8_t *p = iov[i].iov_base;
		size_t len = iov[i].iov_len;

		total += len;
		if (held) { /* a block split between pieces */
			size_t take = len < BLOCK - held ? len : BLOCK - held;

			memcpy(carry + held, p, take);
			held += take;
			p += take;
			len -= take;
			if (held < BLOCK)
				continue;
			NAME(enc)(&s, carry, out);
			out += BLOCK;
			held = 0;
		}
		for (; len >= 2 * BLOCK; p += 2 * BLOCK, out += 2 * BLOCK, len -= 2 * BLOCK) {
			NAME(enc)(&s, p, out); /* two blocks a turn: faster */
			NAME(enc)(&s, p + BLOCK, out + BLOCK);
		}
		if (len >= BLOCK) {
			NAME(enc)(&s, p, out);
			p += BLOCK, out += BLOCK, len -= BLOCK;
		}
		if (len) {
			memcpy(carry, p, len);
			held = len;
		}
	}
	if (held) { /* the last block, zero-padded; its ciphertext truncated */
		uint8_t last[BLOCK];

		memset(carry + held, 0, sizeof(carry) - held);
		NAME(enc)(&s, carry, last);
		memcpy(out, last, held);
	}
	_mm_storeu_si128((__m128i *)tag, NAME(finalize)(&s, ad_len, total));
}

static TARGET int NAME(open)(const uint8_t *key, const uint8_t *nonce, const uint8_t *ad,
			     size_t ad_len, uint8_t *buf, size_t len, const uint8_t *tag)
{
	struct NAME(state) s;
	uint8_t *p = buf;
	size_t left = len;
	__m128i ok;

	NAME(init)(&s, key, nonce);
	NAME(absorb)(&s, ad, ad_len);
	for (; left >= 2 * BLOCK; p += 2 * BLOCK, left -= 2 * BLOCK) {
		NAME(dec)(&s, p);
		NAME(dec)(&s, p + BLOCK);
	}
	if (left >= BLOCK) {
		NAME(dec)(&s, p);
		p += BLOCK, left -= BLOCK;
	}
	if (left) {
		/* the last block: decrypt its padded ciphertext, keep |left| bytes, and update
		 * with the plaintext zero-padded (not the keystream's tail) */
		uint8_t pad[BLOCK];

		memset(pad, 0, sizeof(pad));
		memcpy(pad, p, left);
		V_STORE(pad, V_XOR(V_LOAD(pad), NAME(z0)(&s)));
		V_STORE(pad + BLOCK / 2, V_XOR(V_LOAD(pad + BLOCK / 2), NAME(z1)(&s)));
		memcpy(p, pad, left);
		memset(pad + left, 0, sizeof(pad) - left);
		NAME(update)(&s, V_LOAD(pad), V_LOAD(pad + BLOCK / 2));
	}
	/* constant time: one comparison of all 16 bytes */
	ok = _mm_cmpeq_epi8(NAME(finalize)(&s, ad_len, len), _mm_loadu_si128((const __m128i *)tag));
	if (_mm_movemask_epi8(ok) != 0xffff) {
		memset(buf, 0, len);
		return -EBADMSG;
	}
	return 0;
}
