/*
 * replay — feed every file of the given corpus directories (or the given files)
 * to LLVMFuzzerTestOneInput, once each, in name order. This is how the corpus
 * runs in the normal test suite: compiled by any compiler, no libFuzzer needed;
 * the ASan+UBSan build catches what the fuzzer caught.
 *
 * usage: replay PATH...   (exit 0: all inputs ran; 1: an input could not be read
 *                          or no input was found; a defect aborts)
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/fuzz/fuzz.h"

/* Exactly len bytes in a buffer of exactly len bytes, so ASan sees any over-read. */
static int replay_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf = NULL;
	long len;
	int rc = -1;

	if (!f) {
		fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
		return -1;
	}
	if (fseek(f, 0, SEEK_END) || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET))
		goto out;
	buf = malloc(len ? (size_t)len : 1);
	if (!buf || (len && fread(buf, 1, (size_t)len, f) != (size_t)len))
		goto out;
	LLVMFuzzerTestOneInput(len ? buf : NULL, (size_t)len);
	rc = 0;
out:
	if (rc)
		fprintf(stderr, "replay: cannot read %s\n", path);
	free(buf);
	fclose(f);
	return rc;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
	return strcmp((*a)->d_name, (*b)->d_name);
}

static int replay_path(const char *path, unsigned *count)
{
	struct dirent **names;
	struct stat st;
	int n, rc = 0;

	if (stat(path, &st)) {
		fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
		return -1;
	}
	if (!S_ISDIR(st.st_mode)) {
		rc = replay_file(path);
		*count += rc == 0;
		return rc;
	}
	n = scandir(path, &names, NULL, by_name);
	if (n < 0) {
		fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
		return -1;
	}
	for (int i = 0; i < n; i++) {
		char file[4096];

		if (names[i]->d_name[0] != '.') {
			snprintf(file, sizeof(file), "%s/%s", path, names[i]->d_name);
			if (stat(file, &st) == 0 && S_ISREG(st.st_mode)) {
				if (replay_file(file))
					rc = -1;
				else
					(*count)++;
			}
		}
		free(names[i]);
	}
	free(names);
	return rc;
}

int main(int argc, char **argv)
{
	unsigned count = 0;
	int rc = 0;

	if (argc < 2) {
		fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
		return 2;
	}
	for (int i = 1; i < argc; i++)
		if (replay_path(argv[i], &count))
			rc = 1;
	printf("replayed %u inputs\n", count);
	/* An empty corpus would pass without testing anything. */
	if (!count) {
		fprintf(stderr, "replay: no inputs found\n");
		rc = 1;
	}
	return rc;
}
