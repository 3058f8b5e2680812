/*
 * proc.c - spawn a program, capture its output, reap it (see proc.h).
 */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

int proc_run(const char *const argv[], unsigned capture, char *out, size_t outlen,
	     int *exit_status)
{
	posix_spawn_file_actions_t fa;
	int pipefd[2], status, r;
	size_t len = 0;
	pid_t pid;

	*exit_status = -1;
	if (out && outlen)
		out[0] = '\0';
	if (!argv || !argv[0])
		return -EINVAL;
	if (pipe2(pipefd, O_CLOEXEC) < 0)
		return -errno;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	if (capture & PROC_STDOUT)
		posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
	else
		posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	if (capture & PROC_STDERR)
		posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
	else
		posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
	r = posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(pipefd[1]);
	if (r != 0) {
		close(pipefd[0]);
		return -r;
	}
	for (;;) {
		char chunk[4096];
		ssize_t n = read(pipefd[0], chunk, sizeof(chunk));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		if (out && len + 1 < outlen) {
			size_t room = outlen - 1 - len, take = (size_t)n < room ? (size_t)n : room;

			memcpy(out + len, chunk, take);
			len += take;
			out[len] = '\0';
		}
	}
	close(pipefd[0]);
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return -errno;
	}
	if (WIFEXITED(status))
		*exit_status = WEXITSTATUS(status);
	else if (WIFSIGNALED(status))
		*exit_status = 128 + WTERMSIG(status);
	return 0;
}
