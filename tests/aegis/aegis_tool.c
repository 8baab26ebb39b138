/*
 * aegis_tool — kvblend's own AEGIS (proto/aegis.c) on the command line, for the
 * differential test against the reference library (test_aegis_ref.py). One case per
 * line on stdin:
 *   VARIANT KEY NONCE AD MSG SPLIT      (VARIANT L or X; hex fields, "-" when empty)
 * answered on stdout by one line:
 *   CT TAG BACK REFUSED
 * CT and TAG from sealing MSG given in two pieces split at byte SPLIT; BACK 1 when
 * opening CT gives MSG back; REFUSED 1 when CT with its tag's last bit flipped is
 * refused and leaves the buffer zeroed. The line "?" is answered with the variants
 * this CPU runs ("L X", "L", or "-").
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/aegis.h"

#define MAX_BYTES (1u << 20)

static size_t unhex(const char *s, uint8_t *out, size_t cap)
{
	size_t n = strlen(s);

	if (!strcmp(s, "-"))
		return 0;
	if (n % 2 || n / 2 > cap) {
		fprintf(stderr, "aegis_tool: bad hex field of %zu characters\n", n);
		exit(2);
	}
	for (size_t i = 0; i < n / 2; i++) {
		unsigned v;

		if (sscanf(s + 2 * i, "%2x", &v) != 1) {
			fprintf(stderr, "aegis_tool: bad hex at %zu\n", 2 * i);
			exit(2);
		}
		out[i] = (uint8_t)v;
	}
	return n / 2;
}

static void put_hex(const uint8_t *p, size_t n)
{
	if (!n)
		putchar('-');
	for (size_t i = 0; i < n; i++)
		printf("%02x", p[i]);
}

int main(void)
{
	static char line[4 * MAX_BYTES + 1024];
	static uint8_t ad[MAX_BYTES], msg[MAX_BYTES], ct[MAX_BYTES], buf[MAX_BYTES];
	uint8_t key[KVB_AEGIS_KEY_LEN], nonce[KVB_AEGIS_NONCE_LEN], tag[KVB_AEGIS_TAG_LEN];

	while (fgets(line, sizeof(line), stdin)) {
		char var[4], k[64], nn[64], *fa = malloc(2 * MAX_BYTES + 2),
						   *fm = malloc(2 * MAX_BYTES + 2);
		size_t ad_len, len, split;
		enum kvb_aegis_variant v;
		struct iovec iov[2];
		int back, refused = 1;

		if (!strncmp(line, "?", 1)) {
			bool l = kvb_aegis_available(KVB_AEGIS_128L);
			bool x = kvb_aegis_available(KVB_AEGIS_128X2);

			printf("%s\n", l && x ? "L X" : l ? "L" : x ? "X" : "-");
			fflush(stdout);
			free(fa);
			free(fm);
			continue;
		}
		if (!fa || !fm || sscanf(line, "%3s %63s %63s %s %s %zu", var, k, nn, fa, fm,
					 &split) != 6) {
			fprintf(stderr, "aegis_tool: a line needs VARIANT KEY NONCE AD MSG SPLIT\n");
			return 2;
		}
		v = var[0] == 'X' ? KVB_AEGIS_128X2 : KVB_AEGIS_128L;
		if (unhex(k, key, sizeof(key)) != sizeof(key) ||
		    unhex(nn, nonce, sizeof(nonce)) != sizeof(nonce)) {
			fprintf(stderr, "aegis_tool: key and nonce are 16 bytes\n");
			return 2;
		}
		ad_len = unhex(fa, ad, sizeof(ad));
		len = unhex(fm, msg, sizeof(msg));
		free(fa);
		free(fm);
		if (split > len)
			split = len;
		iov[0] = (struct iovec){ msg, split };
		iov[1] = (struct iovec){ msg + split, len - split };
		if (kvb_aegis_seal(v, key, nonce, ad, ad_len, iov, 2, ct, tag)) {
			fprintf(stderr, "aegis_tool: variant %s not available\n", var);
			return 2;
		}
		memcpy(buf, ct, len);
		back = !kvb_aegis_open(v, key, nonce, ad, ad_len, buf, len, tag) &&
		       !memcmp(buf, msg, len);
		memcpy(buf, ct, len);
		tag[15] ^= 1;
		if (kvb_aegis_open(v, key, nonce, ad, ad_len, buf, len, tag) != -EBADMSG)
			refused = 0;
		for (size_t i = 0; i < len; i++)
			refused &= buf[i] == 0;
		tag[15] ^= 1;
		put_hex(ct, len);
		putchar(' ');
		put_hex(tag, sizeof(tag));
		printf(" %d %d\n", back, refused);
		fflush(stdout);
	}
	return 0;
}
