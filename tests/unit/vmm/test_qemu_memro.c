/*
 * test_qemu_memro.c - the QEMU preload (vmm/qemu_memro.c) as kiln-node carries it: its bytes
 * written to a file and preloaded into a Python that makes the calls QEMU 7.2 makes on a memory
 * backend's file (open for reading and writing, fallocate(PUNCH_HOLE), close): the named file is
 * opened read-only and never punched, any other file and a later file under the same descriptor
 * number are as without the preload, and nothing the program starts inherits LD_PRELOAD.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"
#include "vmm/qemu_memro.h"

#define LEN 65536

/* What the program checks and prints; its exit status says whether every check held. */
static const char prog[] =
	"import ctypes, fcntl, os, subprocess\n"
	"libc = ctypes.CDLL(None, use_errno=True)\n"
	"libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]\n"
	"PUNCH = 3  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE\n"
	"def mode(fd): return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE\n"
	"img = os.open('img', os.O_RDWR)\n"
	"assert mode(img) == os.O_RDONLY, 'img opened for writing'\n"
	"assert libc.fallocate(img, PUNCH, 0, 8192) == 0, 'punch on img failed'\n"
	"other = os.open('other', os.O_RDWR)\n"
	"assert mode(other) == os.O_RDWR, 'other opened read-only'\n"
	"assert libc.fallocate(other, PUNCH, 0, 8192) == 0, 'punch on other failed'\n"
	"n = img\n"
	"os.close(img)\n"
	"later = os.open('later', os.O_RDWR)\n"
	"assert later == n, 'the number was not reused'\n"
	"assert libc.fallocate(later, PUNCH, 0, 8192) == 0, 'punch on later failed'\n"
	"assert 'LD_PRELOAD' not in os.environ, 'LD_PRELOAD kept'\n"
	"out = subprocess.run(['sh', '-c', 'echo \"${LD_PRELOAD-none}\"'], capture_output=True, text=True)\n"
	"assert out.stdout == 'none\\n', out.stdout\n"
	"print('ok')\n";

static void write_file(const char *path, const void *buf, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	CHECK(fd >= 0 && write(fd, buf, n) == (ssize_t)n);
	if (fd >= 0)
		close(fd);
}

/* Bytes of `path` equal to `c` in its first LEN. */
static long count_byte(const char *path, char c)
{
	static char buf[LEN];
	long n = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0 || read(fd, buf, LEN) != LEN) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	close(fd);
	for (size_t i = 0; i < LEN; i++)
		n += buf[i] == c;
	return n;
}

static void test_the_named_file_is_read_only_and_never_punched(void)
{
	char dir[] = "/tmp/kiln-memro-XXXXXX", so[64], env_pre[96], out[256] = "";
	static char data[LEN];
	int pipefd[2], status = -1;
	ssize_t got = 0;
	pid_t pid;

	CHECK(mkdtemp(dir) != NULL);
	CHECK(chdir(dir) == 0);
	memset(data, 'A', sizeof(data));
	write_file("img", data, sizeof(data));
	write_file("other", data, sizeof(data));
	write_file("later", data, sizeof(data));
	snprintf(so, sizeof(so), "%s/memro.so", dir);
	write_file(so, kiln_memro_so, (size_t)(kiln_memro_so_end - kiln_memro_so));
	snprintf(env_pre, sizeof(env_pre), "LD_PRELOAD=%s", so);
	CHECK(pipe(pipefd) == 0);
	pid = fork();
	if (pid == 0) {
		char *const argv[] = { "/usr/bin/python3", "-c", (char *)prog, NULL };
		char *const envp[] = { env_pre, "KILN_QEMU_MEM_RO=img", "PATH=/usr/bin:/bin", NULL };

		dup2(pipefd[1], 1);
		dup2(pipefd[1], 2);
		execve(argv[0], argv, envp);
		_exit(127);
	}
	close(pipefd[1]);
	while (got < (ssize_t)sizeof(out) - 1) {
		ssize_t n = read(pipefd[0], out + got, sizeof(out) - 1 - (size_t)got);

		if (n <= 0)
			break;
		got += n;
	}
	close(pipefd[0]);
	CHECK(waitpid(pid, &status, 0) == pid);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		fprintf(stderr, "program: %s\n", out);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK_STR(out, "ok\n");
	/* the image whole; the others punched for real */
	CHECK_INT((int)count_byte("img", 'A'), LEN);
	CHECK_INT((int)count_byte("other", '\0'), 8192);
	CHECK_INT((int)count_byte("later", '\0'), 8192);
	unlink("img");
	unlink("other");
	unlink("later");
	unlink(so);
	CHECK(chdir("/") == 0);
	CHECK(rmdir(dir) == 0);
}

int main(void)
{
	TEST(test_the_named_file_is_read_only_and_never_punched);
	return test_summary();
}
