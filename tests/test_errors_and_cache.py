"""Clear failures instead of wrong or silent results: the run-statistics cache recomputed when it
cannot be trusted (damaged, mistyped, a link, a FIFO, another user's) and never written through
a link planted beside it; stores that cannot be reached or used (unknown host, refused
connection, no answer, no credentials) named with the fix, exit 2 from every command; a
mistyped group or glob an error with a suggestion in every function that takes one."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import stat
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import fsspec
import pandas as pd
import pytest

import ckptkit
from ckptkit import tunables
from ckptkit.cli import main
from ckptkit.errors import (
    AccessDeniedError,
    CheckpointError,
    KeyNotFoundError,
    MissingCredentialsError,
    NotACheckpointError,
    StorageError,
    UnreachableStoreError,
)
from ckptkit.examples import TinyLM, write_run
from ckptkit.storage import private_files
from ckptkit.storage.private_files import write_private_file

# -- the run-statistics cache -----------------------------------------------------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A training job (FSDP2, 2 ranks, gloo/CPU) that saved DCP checkpoints at steps 1 and 2."""
    return write_run(tmp_path_factory.mktemp("run") / "run", steps=[1, 2])


@pytest.fixture(scope="module")
def fresh(run_folder) -> pd.DataFrame:
    """The run's statistics computed without any cache."""
    return ckptkit.run(str(run_folder)).stats(cache=False)


@pytest.fixture(scope="module")
def good_cache(run_folder, tmp_path_factory) -> bytes:
    """The bytes of the cache file ``Run.stats`` writes for the whole run."""
    path = tmp_path_factory.mktemp("cache") / "stats.parquet"
    ckptkit.run(str(run_folder)).stats(cache=path)
    return path.read_bytes()


def changed(change: Callable[[pd.DataFrame], pd.DataFrame]) -> Callable[[bytes], bytes]:
    """A damage: the good cache's table with ``change`` applied, written back as parquet."""

    def damage(good: bytes) -> bytes:
        out = io.BytesIO()
        change(pd.read_parquet(io.BytesIO(good))).to_parquet(out, index=False)
        return out.getvalue()

    return damage


DAMAGES = {
    "not parquet": lambda good: b"PAR1 not really parquet",
    "cut in half": lambda good: good[: len(good) // 2],
    "strings in shape": changed(lambda f: f.assign(shape=[str(list(s)) for s in f["shape"]])),
    "lists of strings in shape": changed(
        lambda f: f.assign(shape=[[str(n) for n in s] or ["x"] for s in f["shape"]])
    ),
    "negative sizes in shape": changed(lambda f: f.assign(shape=[[-1, *s] for s in f["shape"]])),
    "text in a statistics column": changed(lambda f: f.assign(mean=[str(v) for v in f["mean"]])),
    "fractions in numel": changed(lambda f: f.assign(numel=f["numel"] + 0.5)),
    "numbers as keys": changed(lambda f: f.assign(key=range(len(f)))),
    "identity not text": changed(lambda f: f.assign(identity=0)),
    "a column missing": changed(lambda f: f.drop(columns="fingerprint")),
}


def same_rows(frame: pd.DataFrame, expected: pd.DataFrame) -> None:
    """``frame`` holds ``expected``'s rows (attrs aside)."""
    got, want = frame.copy(), expected.copy()
    got.attrs, want.attrs = {}, {}
    pd.testing.assert_frame_equal(got, want)


def assert_cache_reused(run: ckptkit.runs.Run, cache: Path) -> None:
    """The file written after a recompute is trusted by the next call: no warning, no reads."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = run.stats(cache=cache)
    assert again.attrs["cached"] == ["step1", "step2"] and again.attrs["read"] == []


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_cache_is_recomputed_with_a_warning(
    run_folder, fresh, good_cache, tmp_path, damage
):
    cache = tmp_path / "stats.parquet"
    cache.write_bytes(DAMAGES[damage](good_cache))
    run = ckptkit.run(str(run_folder))
    with pytest.warns(UserWarning, match=rf"{cache}: unreadable statistics cache, ignored"):
        frame = run.stats(cache=cache)
    assert frame.attrs["read"] == ["step1", "step2"] and frame.attrs["cached"] == []
    same_rows(frame, fresh)
    assert_cache_reused(run, cache)


def test_the_good_cache_is_used_as_it_is(run_folder, fresh, good_cache, tmp_path):
    cache = tmp_path / "stats.parquet"
    cache.write_bytes(good_cache)
    run = ckptkit.run(str(run_folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frame = run.stats(cache=cache)
    assert frame.attrs["cached"] == ["step1", "step2"]
    same_rows(frame, fresh)


def test_a_cache_that_is_a_link_is_not_followed(run_folder, fresh, good_cache, tmp_path):
    elsewhere = tmp_path / "elsewhere.parquet"
    elsewhere.write_bytes(good_cache)
    cache = tmp_path / "stats.parquet"
    cache.symlink_to(elsewhere)
    run = ckptkit.run(str(run_folder))
    with pytest.warns(UserWarning, match="a symbolic link, not followed"):
        frame = run.stats(cache=cache)
    assert frame.attrs["read"] == ["step1", "step2"]  # nothing taken from the link's target
    same_rows(frame, fresh)
    assert elsewhere.read_bytes() == good_cache  # the target untouched
    assert not cache.is_symlink() and stat.S_IMODE(cache.stat().st_mode) == 0o600
    assert_cache_reused(run, cache)


def test_a_fifo_at_the_cache_name_is_not_waited_on(run_folder, fresh, tmp_path):
    cache = tmp_path / "stats.parquet"
    os.mkfifo(cache)
    run = ckptkit.run(str(run_folder))
    with pytest.warns(UserWarning, match="not a regular file: a FIFO"):
        frame = run.stats(cache=cache)
    same_rows(frame, fresh)
    assert stat.S_ISREG(cache.lstat().st_mode)
    assert_cache_reused(run, cache)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_of_another_user_is_not_trusted(run_folder, fresh, good_cache, tmp_path):
    cache = tmp_path / "stats.parquet"
    cache.write_bytes(good_cache)
    os.chown(cache, 65534, 65534)
    run = ckptkit.run(str(run_folder))
    with pytest.warns(UserWarning, match="owned by another user"):
        frame = run.stats(cache=cache)
    assert frame.attrs["read"] == ["step1", "step2"]
    same_rows(frame, fresh)
    assert cache.stat().st_uid == os.geteuid()  # replaced by this user's file


def test_links_planted_at_every_predictable_name_are_left_alone(
    run_folder, fresh, tmp_path, monkeypatch
):
    """A shared ``CKPTKIT_CACHE``: links at the cache's name and at the temporary names earlier
    versions used (``.<name>.<pid>.tmp``) lead to files of the victim's; none is written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("CKPTKIT_CACHE", str(shared))
    run = ckptkit.run(str(run_folder))
    name = f"run-stats-{hashlib.sha256(run.url.rstrip('/').encode()).hexdigest()[:16]}.parquet"
    victims = {}
    planted = {
        name: "cache",
        f".{name}.{os.getpid()}.tmp": "pid-temporary",
        f".{name}.tmp": "temporary",
    }
    for link, label in planted.items():
        victims[label] = tmp_path / f"victim-{label}"
        victims[label].write_bytes(f"the victim's {label} file".encode())
        (shared / link).symlink_to(victims[label])
    dangling = tmp_path / "never-created"
    (shared / f".{name}.0.tmp").symlink_to(dangling)

    with pytest.warns(UserWarning, match="a symbolic link, not followed"):
        frame = run.stats(cache=True)
    same_rows(frame, fresh)
    for label, victim in victims.items():
        assert victim.read_bytes() == f"the victim's {label} file".encode()
    assert not dangling.exists()
    cache = shared / name
    assert not cache.is_symlink() and stat.S_IMODE(cache.stat().st_mode) == 0o600
    # nothing left beside it but what was planted
    assert sorted(p.name for p in shared.iterdir()) == sorted([*planted, f".{name}.0.tmp"])
    assert [p.name for p in shared.iterdir() if not p.is_symlink()] == [name]
    assert run.stats(cache=True).attrs["cached"] == ["step1", "step2"]


def test_the_temporary_file_is_created_exclusively(tmp_path, monkeypatch):
    """A link at the random name drawn first is never opened: another name is drawn."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "cache" / "stats.parquet"
    target.parent.mkdir()
    first = f".{target.name}.{'0' * 16}{private_files.TEMPORARY_SUFFIX}"
    (target.parent / first).symlink_to(victim)
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(private_files.secrets, "token_hex", lambda n: next(names))
    write_private_file(target, b"new rows")
    assert target.read_bytes() == b"new rows" and victim.read_bytes() == b"precious"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert (target.parent / first).is_symlink()
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([first, target.name])


# -- stores that cannot be reached or used ------------------------------------------------------


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(tunables, "RETRY_BACKOFF_S", 0.01)


@pytest.fixture
def silent_server():
    """A TCP port that accepts connections and never answers (a hung server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield server.getsockname()[1]
    server.close()


def commands(url: str, tmp_path: Path) -> list[list[str]]:
    """Every command, reading ``url``."""
    return [
        ["inspect", url],
        ["verify", url],
        ["stats", url],
        ["sizes", url],
        ["diff", url, url],
        ["unshard", url, str(tmp_path / "unsharded")],
        ["convert", url, str(tmp_path / "converted"), "--to", "dcp"],
    ]


def exits_2_naming(args: list[str], capsys, *parts: str) -> None:
    """``ckptkit ARGS`` exits 2 with one line on stderr holding every one of ``parts``."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptkit: error:") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, (args, err)


def test_an_unknown_host_is_named_at_once(tmp_path, capsys, fast_backoff):
    url = "https://example.invalid/run/step3"
    with pytest.raises(UnreachableStoreError) as caught:
        ckptkit.open(url)
    assert isinstance(caught.value, StorageError) and isinstance(caught.value, NotACheckpointError)
    message = str(caught.value)
    assert message.startswith(url) and "unknown host" in message and "check the URL" in message
    assert "after" not in message  # a name that does not exist is not retried
    with pytest.raises(UnreachableStoreError, match="unknown host"):
        ckptkit.verify(url)  # not "damage"
    for args in commands(url, tmp_path):
        exits_2_naming(args, capsys, url, "unknown host")


def test_a_refused_connection_is_named_after_retries(tmp_path, capsys, fast_backoff):
    url = "http://127.0.0.1:1/run/step3"
    with pytest.raises(
        UnreachableStoreError, match=r"^http://127\.0\.0\.1:1/run/step3.*connection refused"
    ) as caught:
        ckptkit.open(url)
    assert "after 5 attempts" in str(caught.value)
    for args in commands(url, tmp_path):
        exits_2_naming(args, capsys, url, "connection refused")


def test_a_server_that_never_answers_is_named(silent_server, fast_backoff):
    import aiohttp

    url = f"http://127.0.0.1:{silent_server}/run/step3"
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.2)}}
    with pytest.raises(UnreachableStoreError, match=r"no answer in time\) after 5 attempts"):
        ckptkit.open(url, storage_options=options)
    with pytest.raises(UnreachableStoreError, match="no answer in time"):
        ckptkit.verify(url, storage_options=options)


def test_an_unreachable_s3_endpoint_names_endpoint_url(tmp_path, capsys, fast_backoff):
    url = f"s3://ckpt-{uuid.uuid4().hex[:8]}/run/step3"
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s"}
    with pytest.raises(UnreachableStoreError, match="connection refused") as caught:
        ckptkit.open(url, storage_options=options)
    assert str(caught.value).startswith(url) and "endpoint_url=" in str(caught.value)
    endpoint = ["--storage-option", "endpoint_url=http://127.0.0.1:1"]
    keys = ["--storage-option", "key=k", "--storage-option", "secret=s"]
    exits_2_naming(
        ["verify", url, *endpoint, *keys],
        capsys,
        url,
        "endpoint_url=",
    )


def test_missing_credentials_name_the_url_and_the_fix(s3, ws2, tmp_path, capsys, monkeypatch):
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.put(str(ws2.path), f"{bucket}/step2", recursive=True)
    url = f"s3://{bucket}/step2"
    marker = uuid.uuid4().hex  # options no earlier test used: a client of its own
    options = {"anon": False, "config_kwargs": {"user_agent_extra": marker}}
    assert ckptkit.open(url, storage_options=options).format == "dcp"  # with credentials

    # no credentials anywhere botocore looks (environment, files, instance metadata)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"anon": False, "config_kwargs": {"user_agent_extra": marker + "-none"}}
    with pytest.raises(MissingCredentialsError) as caught:
        ckptkit.open(url, storage_options=options)
    assert isinstance(caught.value, AccessDeniedError)
    message = str(caught.value)
    assert message.startswith(url) and "NoCredentialsError" in message
    assert "--anon" in message and "profile=" in message
    with pytest.raises(MissingCredentialsError):
        ckptkit.verify(url, storage_options=options)
    for command in (["inspect", url], ["verify", url], ["stats", url]):
        exits_2_naming(
            [*command, "--storage-option", f'config_kwargs={{"user_agent_extra": "{marker}-cli"}}'],
            capsys,
            url,
            "--anon",
        )


# -- a selection that matches nothing -----------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(written) -> str:
    return str(written("fsdp2_ws2").path)


SUGGESTION = "groups: model, optim, train"


def misspelt_calls(path: str, out: Path) -> dict[str, Callable[[], object]]:
    """Every API function taking a selection, each with the group ``model`` misspelt."""
    return {
        "load_state_dict": lambda: ckptkit.load_state_dict(path, groups="modle"),
        "from_checkpoint": lambda: ckptkit.from_checkpoint(TinyLM(), path, prefix="modle."),
        "stats": lambda: ckptkit.stats(path, groups="modle"),
        "fingerprint": lambda: ckptkit.fingerprint(path, groups=["modle"]),
        "unshard": lambda: ckptkit.unshard(path, str(out / "u"), groups="modle", progress=False),
        "convert": lambda: ckptkit.convert(
            path, str(out / "c"), to="dcp", groups="modle", progress=False
        ),
    }


@pytest.mark.parametrize(
    "function",
    [
        "load_state_dict",
        "from_checkpoint",
        "stats",
        "fingerprint",
        "unshard",
        "convert",
    ],
)
def test_a_misspelt_group_is_an_error_with_a_suggestion(checkpoint, tmp_path, function):
    call = misspelt_calls(checkpoint, tmp_path)[function]
    with pytest.raises(CheckpointError, match=SUGGESTION) as caught:
        call()
    assert checkpoint in str(caught.value) and "modle" in str(caught.value)
    assert not (tmp_path / "u").exists() and not (tmp_path / "c").exists()


def test_a_misspelt_key_names_the_closest_keys(checkpoint):
    close = "did you mean 'model.embed.weight'"
    with pytest.raises(KeyNotFoundError, match=close):
        ckptkit.load_state_dict(checkpoint, keys="model.embed.weigth")
    with pytest.raises(KeyNotFoundError, match=rf"no tensor matches 'model.embed.weigth'.*{close}"):
        ckptkit.stats(checkpoint, keys=["model.embed.*", "model.embed.weigth"])
    with pytest.raises(KeyNotFoundError, match=close):
        ckptkit.diff(checkpoint, checkpoint, keys="model.embed.weigth")
    # a glob of another group than the one asked for matches nothing there
    with pytest.raises(KeyNotFoundError, match=r"no key in groups \['optim'\] matches 'model\.\*'"):
        ckptkit.load_state_dict(checkpoint, keys="model.*", groups="optim")
    # what is spelt right still works
    assert set(ckptkit.load_state_dict(checkpoint, groups="train")) == {"train"}


def test_a_misspelt_group_over_a_run_is_an_error(run_folder):
    run = ckptkit.run(str(run_folder))
    with pytest.raises(KeyNotFoundError, match=r"no group 'modle' \(groups: model, optim"):
        run.stats(groups="modle", cache=False)


def test_a_misspelt_exclude_is_an_error(checkpoint, tmp_path):
    with pytest.raises(KeyNotFoundError, match=r"exclude='optm\.\*' matches no"):
        ckptkit.unshard(checkpoint, str(tmp_path / "u"), exclude="optm.*", progress=False)


def test_the_cli_names_a_misspelt_group(checkpoint, tmp_path, capsys):
    for args in (
        ["stats", checkpoint, "--groups", "modle"],
        ["unshard", checkpoint, str(tmp_path / "u"), "--groups", "modle"],
        ["convert", checkpoint, str(tmp_path / "c"), "--to", "dcp", "--groups", "modle"],
    ):
        exits_2_naming(args, capsys, checkpoint, "modle", SUGGESTION)
