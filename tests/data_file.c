/* data_file — tamper with a store's data file; see data_file.h. */
#include "tests/data_file.h"

#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

int flip_in_data_file(const char *dir, const uint8_t *needle, bool every)
{
	char path[400];
	struct stat st;
	uint8_t *buf, *at;
	int fd, n = 0;

	snprintf(path, sizeof(path), "%s/data.mdb", dir);
	fd = open(path, O_RDWR);
	assert_true(fd >= 0);
	assert_int_equal(fstat(fd, &st), 0);
	buf = malloc((size_t)st.st_size);
	assert_non_null(buf);
	assert_int_equal(pread(fd, buf, (size_t)st.st_size, 0), st.st_size);
	/* The file's modification time has the kernel's clock tick (a few ms): a write in
	 * the same tick as the store's last commit would look like the store's own. */
	usleep(20000);
	for (at = buf; (at = memmem(at, (size_t)(buf + st.st_size - at), needle, 16)); at += 16) {
		uint8_t b = *at ^ 0x10;

		assert_int_equal(pwrite(fd, &b, 1, at - buf), 1);
		n++;
		if (!every)
			break;
	}
	assert_true(n >= 1);
	close(fd);
	free(buf);
	return n;
}
