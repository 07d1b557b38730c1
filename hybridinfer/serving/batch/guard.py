"""Who may write a batch output: one process at a time, and only the job that began it.

One process per output: `OUT.lock` is held with flock(2) while a job runs and names the holder's pid. The kernel
drops the lock when its process dies, so a lock file left by a killed job (its pid dead) is stale and simply taken
over; on a filesystem without flock the pid itself is checked.

Only this job's output: `OUT.job`, a small JSON file written before the first record, names the job: the SHA-256 of
its input's bytes, the model name the bodies answer to and the shard. An output that is absent or empty is
claimed (and `OUT.job` written); a non-empty output is resumed only when `OUT.job` names this same job. Anything
else (a file of other records, another job's output, the output of this job's input before it was edited) is
refused untouched: resuming it would skip or double lines, or append to a file that is not ours."""

from __future__ import annotations

import errno
import json
import os
import stat

from ...engine.fsutil import fsync_dir
from ...errors import HybridInferError

FORMAT = "hybridinfer.batch-output/1"
_IDENTITY = ("format", "input_sha256", "model_name", "shard")  # what must match to resume; the rest is for people
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class BatchOutputError(HybridInferError):
    """An output a job may not write (another process holds it, it is no output of this job), or a failed write."""


def lock_path(output: str) -> str:
    return output + ".lock"


def sidecar_path(output: str) -> str:
    return output + ".job"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _read_pid(fd: int) -> int | None:
    """The pid in a lock file; None when it is empty; -1 when it holds anything else (not our lock file)."""
    text = os.pread(fd, 64, 0)
    if not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        return -1


class OutputLock:
    """The lock of one output: `acquire()` or BatchOutputError naming the process that holds it; `release()`."""

    def __init__(self, output: str):
        self.output, self.path = output, lock_path(output)
        self._fd = -1

    def _refuse(self, why: str):
        return BatchOutputError(f"the batch output {self.output!r} {why} (lock file {self.path!r}); one job per "
                                f"output: wait for it to end, or name another output")

    def acquire(self) -> OutputLock:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise self._refuse(f"is being written by another process (pid {_read_pid(fd)})") from None
                except OSError as e:
                    if e.errno not in _NO_FLOCK:
                        raise
                    pid = _read_pid(fd)  # no flock here: the pid is all there is to go on
                    if pid is not None and pid > 0 and pid != os.getpid() and _pid_alive(pid):
                        raise self._refuse(f"is being written by another process (pid {pid})") from None
                # the holder that just let go may have removed the file: the lock must be on the file at the path
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                if _read_pid(fd) == -1:
                    raise BatchOutputError(f"{self.path!r} is in the way of the batch output {self.output!r}'s lock "
                                           f"file and is not one; move it, or name another output")
            except BaseException:
                os.close(fd)
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return self

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.unlink(self.path)  # while still held: a process waiting on this file then sees it gone
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def job_identity(input_sha256: str, model_name: str | None, shard: tuple[int, int], input_path: str = "") -> dict:
    return {"format": FORMAT, "input_sha256": input_sha256, "model_name": model_name,
            "shard": f"{shard[0]}/{shard[1]}", "input": input_path}


def read_sidecar(output: str) -> dict | None:
    """The identity in OUT.job, None when there is none; BatchOutputError when the file is no sidecar of ours."""
    path = sidecar_path(output)
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except FileNotFoundError:
        return None
    try:
        got = json.loads(data)
    except (ValueError, RecursionError):
        got = None
    if not isinstance(got, dict) or got.get("format") != FORMAT:
        raise BatchOutputError(f"{path!r} is in the way of the batch output {output!r}'s job file and is not one; "
                               f"move it, or name another output")
    return got


def _mismatch(output: str, have: dict, want: dict) -> str:
    if have.get("input_sha256") != want["input_sha256"]:
        return (f"was begun on another input (SHA-256 {str(have.get('input_sha256'))[:16]}..., "
                f"{have.get('input') or 'unnamed'}; this input's is {want['input_sha256'][:16]}...): the input was "
                f"edited since, or this is another job's output, and resuming would skip or double lines")
    key = next(k for k in _IDENTITY if have.get(k) != want[k])
    return f"was begun with {key} {have.get(key)!r}, not {want[key]!r}"


def claim(output: str, identity: dict) -> bool:
    """May the job `identity` write `output`? True: it resumes its own output; False: the output is absent or empty
    and is now claimed (OUT.job written). Otherwise BatchOutputError, and nothing is changed. Call it holding the
    output's lock."""
    try:
        st = os.stat(output)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise BatchOutputError(f"the batch output {output!r} is not a regular file (a job resumes by reading its "
                               f"output back); name a file")
    have = read_sidecar(output)
    if st is not None and st.st_size > 0:
        if have is None:
            raise BatchOutputError(f"the batch output {output!r} already holds {st.st_size} bytes and is no output "
                                   f"of a batch job (there is no {sidecar_path(output)!r} naming its job): refusing "
                                   f"to touch it; name another output")
        if any(have.get(k) != identity[k] for k in _IDENTITY):
            raise BatchOutputError(f"the batch output {output!r} {_mismatch(output, have, identity)}; it is left as "
                                   f"it is: restore that input or name another output")
        return True
    _write_sidecar(output, identity)
    return False


def _write_sidecar(output: str, identity: dict) -> None:
    path = sidecar_path(output)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(identity, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def check_output(output: str) -> None:
    """What can be told of an output before a job's input is read and its model loaded: no other process writes
    it, and it is absent, empty or some batch job's output (which job is told by `claim`)."""
    OutputLock(output).acquire().release()
    try:
        st = os.stat(output)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_size > 0 and read_sidecar(output) is None:
        claim(output, job_identity("", None, (0, 1)))  # raises the refusal with its message
