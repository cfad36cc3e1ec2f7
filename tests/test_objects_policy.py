"""The objects policy judges the pickle that is written, and outputs never need ckptkit.

``objects="keep" | "drop" | "error"`` acts on every global the written pickle of an object names
(class, reduce arguments, BUILD state, items, nested), not on the decoded view a reader shows:
a ``Counter`` / ``deque`` / OmegaConf ``DictConfig`` carrying a payload in the parts its decoder
drops is refused, left out or listed, and the result says in one sentence what loading the
output will import or call and that ``torch.load(weights_only=True)`` refuses it. Outputs name
torch's dtypes and devices, never ckptkit's classes.

Oracles: torch's own pickling (dtype/device bytes), ``torch.load`` of the outputs (with
``weights_only=True`` in process; with ``weights_only=False`` only in a subprocess, where a
payload that runs touches a marker file), and the globals ``pickletools`` finds in ``data.pkl``.
"""

from __future__ import annotations

import builtins
import collections
import json
import os
import pickle
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from test_objects import lightning_ckpt, user_objects  # noqa: F401 (a fixture)

import ckptkit
from ckptkit.decoding.known_objects import CycleRef, Device
from ckptkit.decoding.unpickler import is_opaque, python3_name
from ckptkit.ops.writers import torch_save

from conformance_cases import CASES, FIXTURES, MEGATRON_ITEMS, Workspace
from isolated import run_script

SYSTEM = f"{os.system.__module__}.system"  # how a pickle names os.system ("posix.system")
OPEN = f"{builtins.open.__module__}.open"  # and builtins.open ("io.open")

# --------------------------------------------------------------------------------------------
# Payloads, and benign classes made to carry them where their decoders look away.


class SystemCall:
    """Pickles as ``os.system(command)``: loading with ``weights_only=False`` runs it."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Opener:
    """Pickles as ``builtins.open(path, "w")``: loading creates the file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


class PayloadCounter(collections.Counter):
    """Pickles as ``collections.Counter(items)`` with a BUILD state holding ``payload``."""

    def __reduce__(self):
        return (collections.Counter, (dict(self),), {"hidden": self.payload})


class PayloadDeque(collections.deque):
    """Pickles as ``collections.deque(items, maxlen)`` with a BUILD state holding ``payload``."""

    def __reduce__(self):
        return (collections.deque, (list(self), self.maxlen), {"hidden": self.payload})


def with_payload(kind, items, payload):
    value = kind(items) if kind is PayloadCounter else kind(items, 4)
    value.payload = payload
    return value


def config_with_payload(payload):
    """A real OmegaConf ``DictConfig`` whose ``_metadata`` (dropped by its decoder) holds
    ``payload``: OmegaConf pickles its metadata with it."""
    from omegaconf import OmegaConf

    config = OmegaConf.create({"lr": 0.1, "model": {"hidden": 4}})
    config.__dict__["_metadata"].key = payload
    return config


def touch(marker: Path) -> SystemCall:
    return SystemCall(f"touch {marker}")


@pytest.fixture
def payloads(tmp_path) -> tuple[Path, dict[str, tuple[str, Path]]]:
    """A state dict saved by torch.save: a tensor, a plain Counter, and a Counter, a deque and
    a DictConfig carrying payloads; returns the file and, by key, the global and marker of
    each payload."""
    markers = {name: tmp_path / f"ran-{name}" for name in ("counter", "deque", "config")}
    state = {
        "w": torch.ones(2),
        "plain": collections.Counter("abracadabra"),
        "counter": with_payload(PayloadCounter, "aab", Opener(markers["counter"])),
        "config": config_with_payload(touch(markers["config"])),
        # last: loading runs its payload, then fails (a deque takes no BUILD state)
        "deque": with_payload(PayloadDeque, [1, 2], touch(markers["deque"])),
    }
    torch.save(state, tmp_path / "p.pt")
    carried = {
        "p.counter": (OPEN, markers["counter"]),
        "p.deque": (SYSTEM, markers["deque"]),
        "p.config": (SYSTEM, markers["config"]),
    }
    assert not any(marker.exists() for marker in markers.values())
    return tmp_path / "p.pt", carried


_LOAD = """
import json, sys
import torch
value = torch.load(sys.argv[1], weights_only=False)
print(json.dumps({str(k): type(v).__name__ for k, v in value.items()}))
"""


def load_in_subprocess(path: Path) -> dict:
    """``torch.load(path, weights_only=False)`` in a fresh interpreter: its keys and their
    values' types."""
    return json.loads(run_script(_LOAD, path, timeout=300).strip().splitlines()[-1])


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return archive.read(name)


def globals_in(pickled: bytes) -> set[str]:
    """The globals a protocol-2 pickle names, as Python 3 (and torch's loader) spells them."""
    found = set()
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add(".".join(python3_name(module, name)))
    return found


def ckptkit_references(pickled: bytes) -> list[str]:
    """The opcodes of a pickle that mention ckptkit other than as string data (the OLMo
    fixtures hold the path of the run that wrote them, ``runs/ckptkit-fixture-…``, as data)."""
    return [
        f"{opcode.name} {arg}"
        for opcode, arg, _ in pickletools.genops(pickled)
        if "ckptkit" in str(arg) and "UNICODE" not in opcode.name
    ]


def refused_by_weights_only(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# Payloads in the parts decoders drop: refused, left out or listed.


@pytest.mark.parametrize("key", ["p.counter", "p.deque", "p.config"])
def test_error_refuses_a_payload_its_decoder_would_drop(payloads, key, tmp_path):
    path, carried = payloads
    name, marker = carried[key]
    with pytest.raises(ckptkit.UnsafePickleError, match=rf"'{key}' holds {name}\b") as info:
        ckptkit.unshard(
            str(path), str(tmp_path / "out"), keys=[key, "p.w"], objects="error", progress=False
        )
    assert info.value.global_name == name
    assert not (tmp_path / "out" / "p.pt").exists() and not marker.exists()


def test_drop_leaves_payloads_out_and_keeps_benign_objects(payloads, tmp_path):
    path, carried = payloads
    result = ckptkit.unshard(str(path), str(tmp_path / "out"), objects="drop", progress=False)
    assert result.dropped == {
        key: f"holds {name} (objects='drop')" for key, (name, _) in carried.items()
    }
    assert not result.opaque and not result.unsafe_globals
    assert "will import or call" not in str(result)
    out = tmp_path / "out" / "p.pt"
    assert load_in_subprocess(out) == {"w": "Tensor", "plain": "Counter"}
    assert not any(marker.exists() for _, marker in carried.values())
    loaded = torch.load(out, weights_only=True)  # a Counter is in torch's allowlist
    assert loaded["plain"] == collections.Counter("abracadabra")


def test_keep_lists_payloads_and_says_what_loading_will_run(payloads, tmp_path):
    path, carried = payloads
    result = ckptkit.unshard(str(path), str(tmp_path / "out"), progress=False)
    assert result.opaque == {key: [name] for key, (name, _) in carried.items()}
    assert set(result.unsafe_globals) == set(carried)  # "plain" is a Counter: torch loads it
    for key, (name, _) in carried.items():
        assert name in result.unsafe_globals[key]
    text = str(result)
    sentence = next(line for line in text.splitlines() if "will import or call" in line)
    assert OPEN in sentence and SYSTEM in sentence and "weights_only=True" in sentence
    assert "omegaconf.dictconfig.DictConfig" in sentence and "collections.deque" in sentence
    assert not any(marker.exists() for _, marker in carried.values())  # nothing ran here
    out = tmp_path / "out" / "p.pt"
    assert globals_in(data_pkl(out)) >= {OPEN, SYSTEM}
    assert refused_by_weights_only(out)
    # what the sentence says: torch.load(weights_only=False) of the output runs the payloads
    command = [sys.executable, "-c", _LOAD, str(out)]
    subprocess.run(command, capture_output=True, timeout=300)  # fails after the deque's ran
    assert all(marker.exists() for _, marker in carried.values())


def test_decoded_view_does_not_hide_payloads(payloads):
    path, _ = payloads
    ckpt = ckptkit.open(str(path))
    assert ckpt.read_object("p.plain") == collections.Counter("abracadabra")
    for key in ("p.counter", "p.deque", "p.config"):
        value = ckpt.read_object(key)
        assert is_opaque(value), (key, value)  # shown as the placeholder, not a clean value
    assert ckpt.read_object("p.counter").state["hidden"].global_name == OPEN


def test_cli_refuses_and_explains(payloads, tmp_path):
    path, carried = payloads

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ckptkit.cli", "unshard", str(path), *args, "--quiet"]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    refused = run(str(tmp_path / "a"), "--objects", "error")
    assert refused.returncode != 0 and f"'p.counter' holds {OPEN}" in refused.stderr
    kept = run(str(tmp_path / "b"))
    assert kept.returncode == 0, kept.stderr
    assert f"p.counter: {OPEN}" in kept.stdout
    assert "will import or call" in kept.stdout and "weights_only=True" in kept.stdout
    assert not any(marker.exists() for _, marker in carried.values())


def test_lightning_checkpoint_with_a_payload_in_its_hparams_metadata(
    lightning_ckpt,  # noqa: F811 (test_objects' fixture)
    tmp_path,
):
    checkpoint = torch.load(lightning_ckpt, weights_only=False)  # Lightning's own file
    marker = tmp_path / "ran"
    checkpoint["hyper_parameters"].__dict__["_metadata"].key = touch(marker)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    src = str(tmp_path / "edited.ckpt")
    key = "edited.hyper_parameters"
    assert is_opaque(ckptkit.open(src).read_object(key))
    with pytest.raises(ckptkit.UnsafePickleError, match=rf"'{key}' holds {SYSTEM}\b"):
        ckptkit.unshard(src, str(tmp_path / "e"), objects="error", progress=False)
    dropped = ckptkit.unshard(src, str(tmp_path / "d"), objects="drop", progress=False)
    assert dropped.dropped == {key: f"holds {SYSTEM} (objects='drop')"}
    # the model (Lightning's state_dict) is the group model, in model.pt; the rest in edited.pt
    assert sorted(f.name for f in dropped.files) == ["edited.pt", "model.pt"]
    keys = load_in_subprocess(tmp_path / "d" / "edited.pt")
    assert "hyper_parameters" not in keys and "optimizer_states" in keys
    assert not marker.exists()
    kept = ckptkit.unshard(src, str(tmp_path / "k"), progress=False)
    assert kept.opaque == {key: [SYSTEM]} and SYSTEM in kept.unsafe_globals[key]
    assert not marker.exists()


def test_untouched_lightning_hparams_are_benign_but_not_weights_only(
    lightning_ckpt,  # noqa: F811 (test_objects' fixture)
    tmp_path,
):
    result = ckptkit.unshard(str(lightning_ckpt), str(tmp_path / "out"), progress=False)
    assert not result.opaque
    (key,) = [k for k in result.unsafe_globals if k.endswith(".hyper_parameters")]
    assert "omegaconf.dictconfig.DictConfig" in result.unsafe_globals[key]
    (written,) = [f for f in result.files if f.name != "model.pt"]  # the model: tensors only
    assert refused_by_weights_only(tmp_path / "out" / written.name)


# --------------------------------------------------------------------------------------------
# Outputs never reference ckptkit.


@pytest.mark.parametrize("item", MEGATRON_ITEMS)
def test_megatron_unshard_loads_without_ckptkit(item, tmp_path):
    source = FIXTURES / item / "checkpoint"
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "unshard", str(source), str(tmp_path), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    outputs = sorted(tmp_path.glob("*.pt"))
    assert "common.pt" in [p.name for p in outputs]
    for path in outputs:
        assert b"ckptkit" not in data_pkl(path), path.name
    code = f"""
import sys
sys.modules["ckptkit"] = None  # import ckptkit now fails
import torch
for path in {[str(p) for p in outputs]!r}:
    torch.load(path, weights_only=False)
ours = torch.load({str(tmp_path / "common.pt")!r}, weights_only=False)
original = torch.load({str(source / "common.pt")!r}, weights_only=False)
dtype = ours["args"].params_dtype
assert isinstance(dtype, torch.dtype) and dtype == original["args"].params_dtype, dtype
assert vars(ours["args"]).keys() == vars(original["args"]).keys()
print(dtype)
"""
    printed = run_script(code, timeout=300).strip()
    expected = "torch.bfloat16" if "bf16" in item else "torch.float32"
    assert printed == expected


def test_dtypes_and_devices_are_pickled_as_torch_pickles_them():
    for name in ("float32", "bfloat16", "float8_e4m3fn", "uint16", "bool"):
        ours, _ = torch_save.dumps(ckptkit.dtypes.dtype(name))
        assert ours == pickle.dumps(getattr(torch, name), protocol=2), name
    for device, theirs in (
        (Device("cuda", 1), torch.device("cuda", 1)),
        (Device("cpu"), torch.device("cpu")),
    ):
        assert torch_save.dumps(device)[0] == pickle.dumps(theirs, protocol=2)


def test_other_ckptkit_classes_are_refused_naming_the_class(tmp_path):
    torch.save({"w": torch.ones(2), "objs": user_objects()}, tmp_path / "u.pt")
    tree = ckptkit.open(str(tmp_path / "u.pt")).read_object("u.objs.tree")  # decoded view
    assert isinstance(tree.state["children"][0].state["parent"], CycleRef)
    with pytest.raises(ckptkit.UsageError, match="known_objects.CycleRef"):
        torch_save.dumps({"tree": tree})
    with pytest.raises(ckptkit.UsageError, match="known_objects.CycleRef"):
        torch_save.pickled_globals({"tree": tree})


def test_the_walk_is_bounded(payloads):
    path, _ = payloads
    ckpt = ckptkit.open(str(path))
    entry = ckpt.catalog.entries["p.config"]
    (value,) = ckpt.reader.read_objects([entry], decode=False, tensors="data")
    assert SYSTEM in torch_save.pickled_globals(value).harmful
    with pytest.raises(ckptkit.PickleLimitError):
        torch_save.pickled_globals(value, budget=10)


def test_weights_only_allowlist_is_torchs():
    from torch._weights_only_unpickler import _get_allowed_globals

    assert set(_get_allowed_globals()) >= torch_save.WEIGHTS_ONLY_GLOBALS
    assert {"torch._utils._rebuild_tensor_v2", "torch.FloatStorage", "torch.float32"} <= (
        torch_save.WEIGHTS_ONLY_GLOBALS
    )


# --------------------------------------------------------------------------------------------
# Every conformance case: the torch output names no ckptkit class, and the globals the result
# reports are the ones torch.load(weights_only=True) refuses.


@pytest.fixture(scope="module")
def workspace(written, tmp_path_factory) -> Workspace:
    return Workspace(written, tmp_path_factory.mktemp("policy-cases"))


def _source_bytes(source: Path) -> bytes:
    """All bytes of a checkpoint's files (the cases are small)."""
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    return b"".join(p.read_bytes() for p in files)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_torch_outputs_never_name_ckptkit(case, workspace, tmp_path):
    source = case.locate(workspace)
    result = ckptkit.unshard(str(source), str(tmp_path / "out"), to="torch", progress=False)
    reported = {name for names in result.unsafe_globals.values() for name in names}
    for written in result.files:
        path = tmp_path / "out" / written.name
        pickled = data_pkl(path)
        assert not ckptkit_references(pickled), (written.name, ckptkit_references(pickled))
        if b"ckptkit" not in _source_bytes(source):
            assert b"ckptkit" not in pickled, written.name
        outside = globals_in(pickled) - torch_save.WEIGHTS_ONLY_GLOBALS
        assert outside <= reported, (written.name, sorted(outside - reported))
        assert refused_by_weights_only(path) == bool(outside), written.name
