"""What may write a batch output, without a model: the lock (one process per output, a dead holder's lock taken
over), the job file (only the job that began an output resumes it; anything else is refused untouched), a failed
write (an error naming the line, the partial line taken back), records that UTF-8 cannot carry, and input lines
read in bounded memory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import tracemalloc

import pytest
from batch_records import FullDisk

pytest.importorskip("pydantic")

from hybridinfer.serving.batch import output as output_mod  # noqa: E402
from hybridinfer.serving.batch.guard import (  # noqa: E402
    BatchOutputError,
    OutputLock,
    check_output,
    claim,
    job_identity,
    lock_path,
    read_sidecar,
    sidecar_path,
)
from hybridinfer.serving.batch.inputfile import JobInput, TooLong, bounded_lines  # noqa: E402
from hybridinfer.serving.batch.jobfile import dumps, ok_record  # noqa: E402
from hybridinfer.serving.batch.output import Output  # noqa: E402

ID = job_identity("ab" * 32, "m", (0, 1), "job.jsonl")


def _notes(path) -> bytes:
    """40 KB of someone's JSONL that is no batch output."""
    data = b"".join(json.dumps({"note": i, "text": "remember the milk " * 5}).encode() + b"\n" for i in range(400))
    path.write_bytes(data)
    return data


def test_a_foreign_file_is_refused_untouched(tmp_path):
    notes = tmp_path / "notes.jsonl"
    data = _notes(notes)
    assert len(data) > 40_000
    for check in (lambda: claim(str(notes), ID), lambda: check_output(str(notes))):
        with pytest.raises(BatchOutputError, match="no output of a batch job"):
            check()
    assert notes.read_bytes() == data and not os.path.exists(sidecar_path(str(notes)))
    # batch records without the job file beside them: whose job they answer is unknown, so refused too
    recs = tmp_path / "recs.jsonl"
    recs.write_bytes(dumps(ok_record(1, "a", {})))
    with pytest.raises(BatchOutputError, match="no output of a batch job"):
        claim(str(recs), ID)


def test_only_the_job_that_began_an_output_resumes_it(tmp_path):
    out = str(tmp_path / "out.jsonl")
    assert claim(out, ID) is False and read_sidecar(out)["input_sha256"] == ID["input_sha256"]
    assert not os.path.exists(out)  # the job file comes first; the output is made by Output
    with open(out, "wb") as f:
        f.write(dumps(ok_record(1, "a", {})))
    data = open(out, "rb").read()
    assert claim(out, dict(ID, input="moved.jsonl")) is True  # the same job (the input's name is not its identity)
    for other, what in ((dict(ID, input_sha256="cd" * 32), "another input"), (dict(ID, model_name="n"), "model_name"),
                        (dict(ID, shard="1/2"), "shard")):
        with pytest.raises(BatchOutputError, match=what):
            claim(out, other)
    assert open(out, "rb").read() == data and read_sidecar(out) == ID
    # an empty output is anyone's: claimed again by a new job
    open(out, "wb").close()
    new = dict(ID, input_sha256="cd" * 32)
    assert claim(out, new) is False and read_sidecar(out) == new
    # a file in the way of the job file, or not a regular file as the output: refused
    (tmp_path / "x.jsonl.job").write_text("my own notes\n")
    with pytest.raises(BatchOutputError, match="in the way"):
        claim(str(tmp_path / "x.jsonl"), ID)
    assert (tmp_path / "x.jsonl.job").read_text() == "my own notes\n"
    with pytest.raises(BatchOutputError, match="not a regular file"):
        check_output("/dev/full")


_HOLD = """
import sys, time
from hybridinfer.serving.batch.guard import OutputLock
OutputLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(out: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", _HOLD, out], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline() == "held\n"
    return p


def test_one_process_per_output_and_a_dead_holders_lock_is_taken_over(tmp_path):
    out = str(tmp_path / "out.jsonl")
    p = _holder(out)
    try:
        assert open(lock_path(out)).read().strip() == str(p.pid)
        for _ in range(2):  # refused while the other process lives, however often asked
            with pytest.raises(BatchOutputError, match=f"another process \\(pid {p.pid}\\)"):
                OutputLock(out).acquire()
        with pytest.raises(BatchOutputError, match=f"pid {p.pid}"):
            check_output(out)
    finally:
        p.kill()
        p.wait(timeout=30)
    assert open(lock_path(out)).read().strip() == str(p.pid)  # killed: its lock file stays, stale
    lock = OutputLock(out).acquire()
    assert open(lock_path(out)).read().strip() == str(os.getpid())
    with pytest.raises(BatchOutputError):  # a second holder in this process is refused as well
        OutputLock(out).acquire()
    lock.release()
    assert not os.path.exists(lock_path(out))
    with OutputLock(out):
        pass
    (tmp_path / "y.jsonl.lock").write_text("a file of mine\n")
    with pytest.raises(BatchOutputError, match="in the way"):
        OutputLock(str(tmp_path / "y.jsonl")).acquire()
    assert (tmp_path / "y.jsonl.lock").read_text() == "a file of mine\n"


def test_a_failed_write_names_the_line_and_takes_back_the_partial_line(tmp_path, monkeypatch):
    path = str(tmp_path / "out.jsonl")
    out = Output(path, sync_every=1)
    out.write(ok_record(1, "a", {"x": 1}))
    whole = open(path, "rb").read()
    monkeypatch.setattr(output_mod, "os", FullDisk(1, short_last=True))
    with pytest.raises(BatchOutputError, match="input line 2 .*No space left"):
        out.write(ok_record(2, "b", {"x": 2}))
    assert out.failed and open(path, "rb").read() == whole and 2 not in out.done
    monkeypatch.undo()
    out.close()


def test_a_lone_surrogate_is_written_as_its_escape():
    rec = ok_record(3, "bad\ud800", {"text": "x\udfff"})
    line = dumps(rec)
    assert line.endswith(b"\n") and b"\\ud800" in line
    assert json.loads(line) == rec  # reads back the same


def test_lines_are_read_in_bounded_memory(tmp_path):
    path = tmp_path / "job.jsonl"
    huge = b'{"custom_id": "big", "prompt": "' + b"x" * (10 << 20) + b'"}\n'
    path.write_bytes(b'{"a": 1}\n' + huge + b"\n" + b"y" * 100)
    h = hashlib.sha256()
    tracemalloc.start()
    with open(path, "rb") as f:
        got = list(bounded_lines(f, 1 << 16, h))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [(1, b'{"a": 1}\n'), (2, TooLong(len(huge) - 1)), (3, b"\n"), (4, b"y" * 100)]
    assert peak < 4 << 20, peak  # a 10 MB line is never held
    assert h.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    # the limit counts a line without its newline
    assert list(bounded_lines(io.BytesIO(b"abc\nabcd\nabc"), 3)) == [(1, b"abc\n"), (2, TooLong(4)), (3, b"abc")]


def test_a_pipe_is_read_once_and_a_device_refused(tmp_path):
    r, w = os.pipe()
    data = b"".join(b'{"n": %d}\n' % i for i in range(20000))  # more than a pipe holds: written while read

    def feed():
        with os.fdopen(w, "wb") as f:
            f.write(data)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    inp = JobInput(f"/dev/fd/{r}", 1 << 20, spool_dir=str(tmp_path))
    try:
        assert inp.is_pipe
        for _ in range(2):  # every pass sees all of it
            assert b"".join(raw for _, raw in inp.lines()) == data
    finally:
        inp.close()
        os.close(r)
        t.join(30)
    assert os.listdir(tmp_path) == []  # the copy has no name
    with pytest.raises(ValueError, match="neither a file nor a pipe"):
        JobInput("/dev/zero", 1 << 20)
