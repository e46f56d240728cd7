"""Storage errors are clear and early: each names the storage URL and the cause, before any processing.

Unreachable endpoint, missing bucket, no permission (moto with IAM enforced), read-only local path,
missing backend, and bounded retries of transient errors (a proxy answering 503 in front of moto).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from harness import REPO, assert_exactly_once, base_env, committed_values
from s3 import FaultProxy, MotoServer, free_port

from torch_batch_process import StorageError, TorchBatchProcessor, torch_batch_process
from torch_batch_process.shell_commands import pip_install
from torch_batch_process.storage.registry import open_storage as Storage

BUILT: list[int] = []


class Writer(TorchBatchProcessor):
    def __init__(self, context):
        BUILT.append(1)
        self.context = context
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        self.total.update(int(sum(batch)))
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps([int(v) for v in batch]))


def run_job(url: str, **kwargs):
    BUILT.clear()
    return torch_batch_process(Writer, list(range(20)), batch_size=2, checkpoint_interval=2, storage_path=url, **kwargs)


def test_unreachable_endpoint_is_a_prompt_error_naming_url_and_cause(moto_server):
    port = free_port()  # nothing listens there
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    url = "s3://some-bucket/job"
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        run_job(url, storage_options=options)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert url in message and "cannot reach the storage endpoint" in message and str(port) in message
    assert "attempts" in message  # connection errors are retried, a bounded number of times
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert BUILT == []  # before any processing


def test_storage_options_from_env_and_argument_reach_the_filesystem(moto_server, monkeypatch, tmp_path):
    """Without AWS_ENDPOINT_URL the endpoint comes from TBP_STORAGE_OPTIONS (JSON) or storage_options=."""
    bucket = moto_server.new_bucket()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = {"client_kwargs": {"endpoint_url": moto_server.endpoint}}
    monkeypatch.setenv("TBP_STORAGE_OPTIONS", json.dumps(options))
    result = run_job(f"s3://{bucket}/from-env")
    assert result.finished and result.metrics == {"total": sum(range(20))}
    monkeypatch.delenv("TBP_STORAGE_OPTIONS")
    result = run_job(f"s3://{bucket}/from-arg", storage_options=options)
    assert result.finished
    for job in ("from-env", "from-arg"):
        assert_exactly_once(committed_values_with(f"s3://{bucket}/{job}", options), 20)


def committed_values_with(url: str, options: dict) -> object:
    from collections import Counter

    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **options)
    counts: Counter[int] = Counter()
    for path in fs.find(f"{root}/outputs"):
        counts.update(json.loads(fs.cat_file(path)))
    return counts


def test_missing_bucket_is_an_error_naming_the_bucket(moto_server):
    bucket = f"tbp-missing-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/job"
    with pytest.raises(StorageError) as info:
        run_job(url)
    message = str(info.value)
    assert url in message and bucket in message and "does not exist" in message
    assert BUILT == []


@pytest.fixture(scope="module")
def iam_server():
    """A moto server of its own that enforces IAM: a reader (list + get) and a user without any policy."""
    server = MotoServer()
    try:
        bucket = server.new_bucket()
        arns = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
        reader = server.user_with_policy(
            "reader", [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": arns}]
        )
        nobody = server.user_with_policy("nobody", [])
        server.enforce_auth()
        yield server, bucket, reader, nobody
    finally:
        server.stop()


def _options(server: MotoServer, key: tuple[str, str]) -> dict:
    return {"key": key[0], "secret": key[1], "client_kwargs": {"endpoint_url": server.endpoint}}


def test_no_permission_to_read_is_an_error_before_anything(iam_server):
    server, bucket, _reader, nobody = iam_server
    url = f"s3://{bucket}/job"
    with pytest.raises(StorageError) as info:
        run_job(url, storage_options=_options(server, nobody))
    assert url in str(info.value) and "permission denied" in str(info.value)
    assert BUILT == []


def test_no_permission_to_write_is_an_error_before_processing_and_nothing_is_written(iam_server):
    server, bucket, reader, _nobody = iam_server
    url = f"s3://{bucket}/job"
    with pytest.raises(StorageError) as info:
        run_job(url, storage_options=_options(server, reader))
    message = str(info.value)
    assert url in message and "permission denied" in message
    assert BUILT == []
    listing = server.client("s3", key=reader[0], secret=reader[1]).list_objects_v2(Bucket=bucket)
    assert listing.get("KeyCount", 0) == 0


_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_storage_errors import BUILT, run_job
    try:
        run_job({url!r})
    except Exception as exc:
        print(json.dumps({{"type": type(exc).__name__, "message": str(exc), "built": len(BUILT)}}))
    else:
        print(json.dumps({{"type": None, "built": len(BUILT)}}))
    """
)


def _read_only_command(tmp_path: Path, script: str) -> list[str]:
    """A command running ``script`` where ``tmp_path/ro`` is read-only for it.

    As root, permissions do not stop writes, so the folder is bind-mounted read-only in a private
    mount namespace of the child (``unshare -m``); otherwise ``chmod`` does it.
    """
    source, target = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o555)
        return [sys.executable, "-c", script]
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("running as root without unshare/mount: cannot make a read-only folder")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind -o ro {source} {target} && ! touch {target}/x 2>/dev/null"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {probe.stderr.decode(errors='replace')[-300:]}")
    mount = f'mount --bind -o ro {source} {target} && exec "$0" -c "$1"'
    return ["unshare", "-m", "sh", "-c", mount, sys.executable, script]


@pytest.mark.slow
def test_read_only_local_path_is_an_error_before_processing(tmp_path):
    url = str(tmp_path / "ro" / "job")
    script = _READ_ONLY_SCRIPT.format(tests=str(REPO / "tests"), url=url)
    proc = subprocess.run(
        _read_only_command(tmp_path, script), env=base_env(), capture_output=True, text=True, timeout=120, cwd=str(REPO)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["type"] == "StorageError", outcome
    message = outcome["message"]
    assert url in message and ("read-only" in message or "permission denied" in message)
    assert outcome["built"] == 0


def test_missing_backend_names_the_extra_to_install():
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(StorageError) as info:
        run_job("gs://some-bucket/job")
    message = str(info.value)
    assert "gs://some-bucket/job" in message and pip_install("gcs") in message
    assert BUILT == []


@pytest.fixture
def proxy(moto_server):
    fault_proxy = FaultProxy(moto_server.endpoint)
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_transient_errors_are_retried_with_backoff(moto_server, proxy):
    url = f"s3://{moto_server.new_bucket()}/job"
    storage = Storage(url, {"client_kwargs": {"endpoint_url": proxy.endpoint}})
    proxy.fail_next(3)
    handler = _Records()
    logger = logging.getLogger("torch_batch_process.storage")  # the retry warnings of every backend
    logger.addHandler(handler)
    try:
        storage.write_bytes("a.json", b"{}")
    finally:
        logger.removeHandler(handler)
    assert proxy.failed == 3
    assert storage.read_bytes("a.json") == b"{}"
    retries = [r.getMessage() for r in handler.records if "retry" in r.getMessage()]
    assert len(retries) == 3 and "503" in retries[0], retries


def test_retries_are_bounded_and_the_error_is_clear(moto_server, proxy, monkeypatch):
    url = f"s3://{moto_server.new_bucket()}/job"
    storage = Storage(url, {"client_kwargs": {"endpoint_url": proxy.endpoint}})
    proxy.fail_always()
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.write_bytes("a.json", b"{}")
    assert proxy.failed == 5  # TBP_STORAGE_RETRIES default: 5 attempts, no hidden retry layer below
    assert time.monotonic() - started < 15
    message = str(info.value)
    assert url in message and "after 5 attempts" in message and "503" in message
    monkeypatch.setenv("TBP_STORAGE_RETRIES", "2")
    proxy.failed = 0
    with pytest.raises(StorageError):
        storage.read_bytes("a.json")
    assert proxy.failed == 2


def test_an_endpoint_that_accepts_and_never_answers_is_a_bounded_error_not_a_hang(moto_server, monkeypatch):
    """A stalled endpoint (a frozen proxy or server: connections accepted, nothing answered): every write is a read
    timeout, retried a bounded number of times, then a StorageError. botocore's ``Expect: 100-continue`` on
    file-like bodies (uploads; PUTs its checksums wrap) made aiohttp wait for the server's go-ahead with no timeout:
    a job's writes, its lease renewal and its stop hung there for good."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:  # accepts, reads nothing, answers nothing
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("TBP_STORAGE_RETRIES", "2")
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    options = {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": {"read_timeout": 1, "connect_timeout": 1}}
    storage = Storage("s3://stalled-bucket/job", options)
    local = Path(os.environ.get("TMPDIR", "/tmp")) / f"tbp-stalled-{uuid.uuid4().hex}"
    local.write_bytes(b"z" * 1000)
    try:
        for what, write in (
            ("write", lambda: storage.write_bytes("a.json", b"{}")),
            ("upload", lambda: storage.put_file(local, "b.bin")),
        ):
            outcome: list[BaseException] = []
            attempt = threading.Thread(target=lambda o=outcome, w=write: o.append(_raised(w)), daemon=True)
            started = time.monotonic()
            attempt.start()
            attempt.join(timeout=30)  # a hang fails the test instead of holding it
            elapsed = time.monotonic() - started
            assert outcome, f"{what}: still waiting after {elapsed:.0f}s"
            error = outcome[0]
            assert isinstance(error, StorageError), repr(error)
            assert "after 2 attempts" in str(error) and "timeout" in str(error).lower(), error
    finally:
        local.unlink()
        listener.close()
        for connection in held:
            connection.close()


def _raised(call) -> BaseException:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - handed to the test's thread
        return error
    return AssertionError("no error")


def test_job_completes_exactly_once_through_a_flaky_object_store(moto_server, proxy):
    url = f"s3://{moto_server.new_bucket()}/job"
    proxy.fail_randomly(0.1)  # one request in ten answers 503 Slow Down
    result = run_job(url, storage_options={"client_kwargs": {"endpoint_url": proxy.endpoint}})
    assert result.finished and result.metrics == {"total": sum(range(20))}
    assert proxy.failed >= 5, (proxy.failed, proxy.requests)
    assert_exactly_once(committed_values(url), 20)


OUTAGE: dict[str, object] = {}
"""``proxy``: the FaultProxy that :class:`RowsAndFiles` makes fail from batch ``at`` on."""


class RowsAndFiles(Writer):
    """Writer's files and record rows; the object store goes away at batch ``OUTAGE["at"]``."""

    def process_batch(self, batch, batch_idx):
        if batch_idx == OUTAGE.get("at"):
            OUTAGE["proxy"].fail_always()  # type: ignore[attr-defined]
        super().process_batch(batch, batch_idx)
        self.context.write({"value": [int(v) for v in batch]})


@pytest.mark.slow
def test_an_outage_in_the_middle_of_a_job_fails_it_promptly_and_the_resume_finishes_exactly_once(
    moto_server, proxy, monkeypatch
):
    """The object store goes away mid-job (every request answers 503): the job fails within its bounded retries with
    a StorageError naming the storage, keeps its last commit, and once the store is back the same call finishes
    with every row and file once (read through the same endpoint).

    Short timers (their defaults are proven elsewhere: test_retries_are_bounded_and_the_error_is_clear for the 5
    attempts, tests/test_lock.py for the lease): 2 attempts per storage operation, so that the failing operations
    queued at the outage (uploads, records, the background publication of earlier commits) give up in a fraction of
    a second instead of ~4 s each; a lease of 4 s, so that the resume, which finds the failed call's lease (it could
    not be removed during the outage) held by this very process, takes it over after 6 s instead of 22 s."""
    from torch_batch_process import read_outputs

    monkeypatch.setenv("TBP_STORAGE_RETRIES", "2")
    monkeypatch.setenv("TBP_LEASE_TTL_S", "4")
    n = 80
    url = f"s3://{moto_server.new_bucket()}/job"
    options = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
    run = dict(batch_size=2, checkpoint_interval=2, storage_path=url, storage_options=options, progress=False)
    OUTAGE.update(proxy=proxy, at=21)  # after 10 commits
    started = time.monotonic()
    try:
        with pytest.raises(StorageError, match=url):
            torch_batch_process(RowsAndFiles, list(range(n)), **run)
    finally:
        OUTAGE.clear()
    assert time.monotonic() - started < 90, "bounded retries, no hang"
    assert proxy.failed > 0, "the outage came before the end of the job"
    proxy.heal()
    result = torch_batch_process(RowsAndFiles, list(range(n)), **run)
    assert result.finished and result.metrics == {"total": sum(range(n))}
    assert 0 < result.batches_skipped < n // 2, "resumed from the last commit, not from zero"
    assert read_outputs(url, storage_options=options).column("value").to_pylist() == list(range(n))
    assert_exactly_once(committed_values(url), n)
