"""Objects are never a reason to refuse: cycles, common classes decoded, everything else
carried through unshard/convert as it was pickled (never run), with ``objects=`` / ``exclude=``.

Oracles: torch's own loader on the original file, and on ckptkit's output in a subprocess that
has the classes (``weights_only=False``: the output must give the original objects back).
"""

from __future__ import annotations

import argparse
import collections
import enum
import json
import pathlib
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptkit
from ckptkit import reading
from ckptkit.decoding.known_objects import CycleRef, Device
from ckptkit.decoding.unpickler import is_opaque

TESTS = pathlib.Path(__file__).parent

# --------------------------------------------------------------------------------------------
# User classes. Any code of theirs that runs bumps CALLS: ckptkit must never run it.

CALLS = collections.Counter()


class Holder:
    """A plain object with attributes (NEWOBJ + BUILD), holding a tensor and a namespace."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def __setstate__(self, state: dict) -> None:
        CALLS["Holder.__setstate__"] += 1
        self.__dict__.update(state)


class TreeNode:
    """Children point back to their parent: a reference cycle through objects."""

    def __init__(self, name: str, parent: TreeNode | None = None) -> None:
        self.name, self.parent, self.children = name, parent, []
        if parent is not None:
            parent.children.append(self)


class Registry(dict):
    """A dict subclass with an attribute: SETITEMS on an object, plus BUILD."""


class Stack(list):
    """A list subclass: APPENDS on an object."""


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


class Reduced:
    """``__reduce__`` with arguments: REDUCE calls the class."""

    def __init__(self, x: int, y: str) -> None:
        CALLS["Reduced.__init__"] += 1
        self.x, self.y = x, y

    def __reduce__(self):
        return (Reduced, (self.x, self.y))


class Color(enum.Enum):
    RED = 1
    GREEN = 2


Point = collections.namedtuple("Point", "x y")


def user_objects() -> dict[str, Any]:
    root = TreeNode("root")
    TreeNode("a", root)
    TreeNode("b", root).children.append(root)  # and a longer loop back
    registry = Registry(alpha=1, beta=torch.arange(3))
    registry.note = "kept"
    return {
        "holder": Holder(w=torch.ones(2, 2), args=argparse.Namespace(lr=0.5), tag="x"),
        "tree": root,
        "registry": registry,
        "stack": Stack([1, "two", torch.zeros(1)]),
        "slotted": Slotted(1, [2, 3]),
        "reduced": Reduced(7, "seven"),
        "color": Color.GREEN,
        "point": Point(1, 2),
        "klass": Holder,
    }


def common_objects() -> dict[str, Any]:
    """Objects of benign, common classes, which ckptkit decodes to real values."""
    return {
        "ns": argparse.Namespace(
            lr=0.1,
            layers=[1, 2],
            ordered=collections.OrderedDict(b=1, a=2),  # mappings at top level are walked:
            default=collections.defaultdict(list, {"k": [1]}),  # inside an object, values
        ),
        "simple": types.SimpleNamespace(a=1, b="two"),
        "device": torch.device("cuda", 1),
        "cpu": torch.device("cpu"),
        "deque": collections.deque([1, 2, 3], maxlen=5),
        "counter": collections.Counter("abracadabra"),
        "scalar": np.float32(1.5),
        "array": np.arange(4, dtype=np.int16),
    }


# --------------------------------------------------------------------------------------------
# Oracle: torch.load of two files in a subprocess that has these classes, compared.


def same(a: Any, b: Any, seen: set | None = None) -> bool:
    """Structural equality that follows objects' attributes and tolerates cycles."""
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (
            a.keys() == b.keys()
            and all(same(a[k], b[k], seen) for k in a)
            and (same(vars(a), vars(b), seen) if hasattr(a, "__dict__") else True)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y, seen) for x, y in zip(a, b, strict=True))
    if isinstance(a, type | enum.Enum) or a is None:
        return a is b
    if hasattr(a, "__slots__") and not hasattr(a, "__dict__"):
        return all(same(getattr(a, s), getattr(b, s), seen) for s in a.__slots__)
    if hasattr(a, "__dict__") and not isinstance(a, argparse.Namespace | types.SimpleNamespace):
        return same(vars(a), vars(b), seen)
    return a == b


def loaded_same(original: pathlib.Path, written: pathlib.Path, skip: tuple = ()) -> dict:
    """In a fresh interpreter that imports these classes: torch.load both files (the output
    ``weights_only=False``) and compare them, top-level keys in ``skip`` left out."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(TESTS)!r})
import test_objects as t
a = torch.load({str(original)!r}, weights_only=False)
b = torch.load({str(written)!r}, weights_only=False)
for key in {list(skip)!r}:
    del a[key], b[key]
print(json.dumps({{"same": t.same(a, b), "keys": sorted(map(str, b))}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Lightning + OmegaConf: cycles in objects, the real trainer checkpoint.


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory) -> pathlib.Path:
    import lightning as L
    from omegaconf import OmegaConf

    path = tmp_path_factory.mktemp("lightning") / "last.ckpt"
    config = OmegaConf.create(
        {"model": {"hidden": 4, "layers": [1, 2], "act": "${name}"}, "name": "gelu", "lr": 0.1}
    )
    model = LitModel(config)
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    data = torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=2)
    trainer.fit(model, data)
    trainer.save_checkpoint(path)
    return path


def _lit_model_class():
    import lightning as L

    class _LitModel(L.LightningModule):
        def __init__(self, config) -> None:
            super().__init__()
            self.save_hyperparameters(config)
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, index):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return _LitModel


try:  # a module-level class, so Lightning's own loader can find it in the subprocess
    LitModel = _lit_model_class()
    LitModel.__name__ = LitModel.__qualname__ = "LitModel"
except ImportError:  # pragma: no cover - lightning is in the test extra
    LitModel = None


def test_lightning_checkpoint_with_omegaconf_hparams_opens_and_decodes(lightning_ckpt):
    from omegaconf import OmegaConf

    original = torch.load(lightning_ckpt, weights_only=False)
    ckpt = ckptkit.open(str(lightning_ckpt))
    group = ckpt.catalog.entries[ckpt.keys()[0]].group
    hparams = ckpt.read_object(f"{group}.hyper_parameters")
    assert hparams == OmegaConf.to_container(original["hyper_parameters"], resolve=False)
    assert hparams["model"]["act"] == "${name}"
    for name, tensor in original["state_dict"].items():
        assert torch.equal(ckpt.read(f"{group}.state_dict.{name}"), tensor)
    step = original["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(ckpt.read(f"{group}.optimizer_states.0.state.0.exp_avg"), step)
    objects = ckpt.objects.set_index("key")
    assert objects.loc[f"{group}.hyper_parameters", "type"] == "dict"
    assert "DictConfig" in objects.loc[f"{group}.hparams_type", "preview"]


def test_lightning_checkpoint_unshards_losslessly(lightning_ckpt, tmp_path):
    """Lightning's ``state_dict`` is the group ``model`` (``model.pt``), the rest of the
    checkpoint its file's group (``last.pt``); put back together they are what Lightning saved,
    and its own loader takes them."""
    out = tmp_path / "out"
    result = ckptkit.unshard(str(lightning_ckpt), str(out), progress=False)
    assert sorted(f.name for f in result.files) == ["last.pt", "model.pt"]
    assert not any("hyper_parameters" in key for key in result.opaque)  # decoded: benign
    # optimizer state keys 0, 1… come back as "0", "1"…, as torch's dcp_to_torch_save gives
    # them, and the state dict without its ``_metadata`` attribute: compared by Lightning below
    code = f"""
import sys, torch
sys.path.insert(0, {str(TESTS)!r})
import test_objects as t
from omegaconf import DictConfig
original = torch.load({str(lightning_ckpt)!r}, weights_only=False)
joined = torch.load({str(out / "last.pt")!r}, weights_only=False)
joined["state_dict"] = torch.load({str(out / "model.pt")!r}, weights_only=True)
a, b = dict(original), dict(joined)
for key in ("optimizer_states", "state_dict"):
    del a[key], b[key]
assert t.same(a, b) and "hyper_parameters" in b
torch.save(joined, {str(tmp_path / "joined.ckpt")!r})
model = t.LitModel.load_from_checkpoint({str(tmp_path / "joined.ckpt")!r}, weights_only=False)
assert isinstance(model.hparams, DictConfig) or isinstance(model.hparams["model"], DictConfig)
assert model.hparams["model"]["hidden"] == 4 and model.hparams["lr"] == 0.1
assert all(torch.equal(model.state_dict()[k], v) for k, v in original["state_dict"].items())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


# --------------------------------------------------------------------------------------------
# Common classes decode to real values; user classes stay placeholders, never run.


def test_common_classes_decode_like_torch_loads_them(tmp_path):
    values = common_objects()
    torch.save({"w": torch.ones(2), "meta": values}, tmp_path / "m.pt")
    oracle = torch.load(tmp_path / "m.pt", weights_only=False)["meta"]
    ckpt = ckptkit.open(str(tmp_path / "m.pt"))
    got = {key: ckpt.read_object(f"m.meta.{key}") for key in values}
    for key in ("ns", "simple", "deque", "counter"):
        assert got[key] == oracle[key] and type(got[key]) is type(oracle[key]), key
    assert type(got["ns"].ordered) is collections.OrderedDict
    assert got["deque"].maxlen == 5 and got["ns"].default.default_factory is list
    assert (
        got["device"] == Device("cuda", 1) and torch.device(str(got["device"])) == oracle["device"]
    )
    assert torch.device(str(got["cpu"])) == oracle["cpu"]
    assert got["scalar"] == oracle["scalar"] and got["scalar"].dtype == np.float32
    assert np.array_equal(got["array"], oracle["array"])
    assert not any(is_opaque(v) for v in got.values())


def test_user_objects_are_placeholders_and_never_run(tmp_path):
    torch.save({"w": torch.ones(2), "objs": user_objects()}, tmp_path / "u.pt")
    before = CALLS.copy()
    ckpt = ckptkit.open(str(tmp_path / "u.pt"))
    holder = ckpt.read_object("u.objs.holder")
    assert is_opaque(holder) and holder.global_name == "test_objects.Holder"
    assert torch.equal(holder.state["w"], torch.ones(2, 2))
    assert holder.state["args"] == argparse.Namespace(lr=0.5)  # decoded inside the object
    tree = ckpt.read_object("u.objs.tree")
    child = tree.state["children"][0]
    assert isinstance(child.state["parent"], CycleRef)  # the cycle, marked
    assert ckpt.objects.set_index("key").loc["u.objs.color", "preview"].startswith("<")
    assert before == CALLS


# --------------------------------------------------------------------------------------------
# Lossless carry-through.


def test_user_objects_are_carried_through_unshard_losslessly(tmp_path):
    torch.save({"w": torch.ones(2), "objs": user_objects()}, tmp_path / "u.pt")
    before = CALLS.copy()
    result = ckptkit.unshard(str(tmp_path / "u.pt"), str(tmp_path / "out"), progress=False)
    assert before == CALLS
    assert result.opaque["u.objs.holder"] == ["test_objects.Holder"]
    assert result.opaque["u.objs.tree"] == ["test_objects.TreeNode"]
    assert "test_objects.Holder" in str(result)
    original = tmp_path / "u.pt"
    assert loaded_same(original, tmp_path / "out" / "u.pt")["same"]


def test_safetensors_side_file_carries_objects(tmp_path):
    torch.save({"w": torch.ones(2), "objs": user_objects()}, tmp_path / "u.pt")
    ckptkit.unshard(str(tmp_path / "u.pt"), str(tmp_path / "st"), to="safetensors", progress=False)
    code = f"""
import sys, torch
sys.path.insert(0, {str(TESTS)!r})
import test_objects as t
a = torch.load({str(tmp_path / "u.pt")!r}, weights_only=False)["objs"]
b = torch.load({str(tmp_path / "st" / "u.objects.pt")!r}, weights_only=False)["objs"]
assert t.same(a, b)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_dcp_with_namespace_and_user_objects_unshards_and_converts(tmp_path):
    args = argparse.Namespace(lr=0.1, layers=[1, 2], device=torch.device("cuda", 1))
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "meta": {"args": args, "holder": Holder(tag="h", w=torch.ones(3))},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    ckpt = ckptkit.open(str(tmp_path / "dcp"))
    assert ckpt.read_object("meta.args") == argparse.Namespace(
        lr=0.1, layers=[1, 2], device=Device("cuda", 1)
    )
    result = ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False)
    assert list(result.opaque) == ["meta.holder"]
    meta = torch.load(tmp_path / "out" / "meta.pt", weights_only=False)
    assert meta["args"] == args and isinstance(meta["args"].device, torch.device)
    assert same(meta["holder"], state["meta"]["holder"])
    # convert to DCP: torch's dcp.load gives the same objects back
    ckptkit.convert(ckpt, str(tmp_path / "dcp2"), progress=False)
    loaded = {"model": {"w": torch.zeros(2, 3)}, "meta": {"args": None, "holder": None}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp2"))
    assert loaded["meta"]["args"] == args and same(
        loaded["meta"]["holder"], state["meta"]["holder"]
    )
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


# --------------------------------------------------------------------------------------------
# objects= and exclude=.


def test_objects_policy_and_exclude(tmp_path):
    torch.save(
        {"w": torch.ones(2), "holder": Holder(a=1), "args": argparse.Namespace(x=1)},
        tmp_path / "p.pt",
    )
    src = str(tmp_path / "p.pt")
    with pytest.raises(ckptkit.UnsafePickleError, match=r"'p.holder' holds test_objects.Holder"):
        ckptkit.unshard(src, str(tmp_path / "e"), progress=False, objects="error")
    assert not (tmp_path / "e" / "p.pt").exists()
    dropped = ckptkit.unshard(src, str(tmp_path / "d"), progress=False, objects="drop")
    assert dropped.dropped == {"p.holder": "holds test_objects.Holder (objects='drop')"}
    out = torch.load(tmp_path / "d" / "p.pt", weights_only=False)
    assert set(out) == {"w", "args"} and out["args"] == argparse.Namespace(x=1)
    excluded = ckptkit.unshard(
        src, str(tmp_path / "x"), progress=False, objects="error", exclude=["p.hold*"]
    )
    assert excluded.dropped == {"p.holder": "exclude='p.hold*'"} and not excluded.opaque
    with pytest.raises(ckptkit.UsageError, match="objects must be"):
        ckptkit.unshard(src, str(tmp_path / "bad"), progress=False, objects="ignore")


def test_cli_objects_and_exclude_flags(tmp_path):
    torch.save({"w": torch.ones(2), "holder": Holder(a=1), "n": 3}, tmp_path / "c.pt")

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ckptkit.cli", "unshard", str(tmp_path / "c.pt"), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    refused = run(str(tmp_path / "a"), "--objects", "error", "--quiet")
    assert refused.returncode != 0 and "test_objects.Holder" in refused.stderr
    kept = run(str(tmp_path / "b"), "--quiet")
    assert kept.returncode == 0 and "c.holder: test_objects.Holder" in kept.stdout
    slim = run(str(tmp_path / "c"), "--exclude", "c.holder", "--exclude", "c.n", "--quiet")
    assert slim.returncode == 0, slim.stderr
    assert set(torch.load(tmp_path / "c" / "c.pt", weights_only=True)) == {"w"}


# --------------------------------------------------------------------------------------------
# Cycles: allowed through objects, refused (naming where) in plain containers.


def test_cycle_of_plain_containers_is_refused_naming_where(tmp_path):
    looped: dict = {"a": 1}
    looped["self"] = looped
    torch.save({"w": torch.ones(1), "cfg": looped}, tmp_path / "loop.pt")
    with pytest.raises(ckptkit.CorruptRecordError, match=r"cycle at <value>\['cfg'\]\['self'\]"):
        ckptkit.open(str(tmp_path / "loop.pt")).keys()


def test_cycles_stay_refused_in_dcp_metadata():
    from ckptkit.decoding.pickle_limits import METADATA_LIMITS, OBJECT_LIMITS, check_value

    node = Holder()
    node.me = [node]
    check_value(node, OBJECT_LIMITS, "obj")  # through an object: fine
    with pytest.raises(ckptkit.CorruptRecordError, match="cycle"):
        check_value(node, METADATA_LIMITS, "metadata")


# --------------------------------------------------------------------------------------------
# Item 5: a file's object tree is decoded once; empty tensors have torch's strides.


def test_read_object_decodes_a_file_once(tmp_path, monkeypatch):
    torch.save(
        {"w": torch.ones(2), "objs": {str(i): {"v": i} for i in range(200)}}, tmp_path / "o.pt"
    )
    ckpt = ckptkit.open(str(tmp_path / "o.pt"))
    calls = collections.Counter()
    real = reading.objects.safe_loads

    def counted(*args, **kwargs):
        calls["safe_loads"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(reading.objects, "safe_loads", counted)
    values = [ckpt.read_object(f"o.objs.{i}.v") for i in range(200)]
    assert values == list(range(200)) and calls["safe_loads"] == 1


def test_empty_tensors_have_torch_strides(tmp_path):
    empties = {
        "a": torch.empty(0),
        "b": torch.empty(0, 3),
        "c": torch.empty(3, 0),
        "d": torch.empty(2, 0, 4, dtype=torch.bfloat16),
        "e": torch.ones(3)[:0],
    }
    torch.save(empties, tmp_path / "e.pt")
    dcp.save({"m": empties}, checkpoint_id=str(tmp_path / "dcp"))
    oracle = torch.load(tmp_path / "e.pt", weights_only=True)
    for path, prefix in ((tmp_path / "e.pt", "e"), (tmp_path / "dcp", "m")):
        ckpt = ckptkit.open(str(path))
        for key, expected in oracle.items():
            got = ckpt.read(f"{prefix}.{key}")
            assert (got.shape, got.stride(), got.dtype) == (
                expected.shape,
                expected.stride(),
                expected.dtype,
            ), key
            assert got.view(torch.uint8).numel() == 0


def test_pickle_of_placeholder_never_imports_its_module():
    """A global whose module does not exist here is written back all the same."""
    payload = b"\x80\x02cno_such_module_xyz\nThing\n)\x81}X\x01\x00\x00\x00aK\x01sb."
    from ckptkit.decoding.unpickler import OBJECT_GLOBALS, safe_loads
    from ckptkit.ops.writers import torch_save

    thing = safe_loads(payload, allow=OBJECT_GLOBALS, source="x", unknown="opaque")
    data, _ = torch_save.dumps({"thing": thing})
    assert b"cno_such_module_xyz\nThing\n" in data and "no_such_module_xyz" not in sys.modules
    again = safe_loads(data, allow=OBJECT_GLOBALS, source="y", unknown="opaque")["thing"]
    assert again.global_name == "no_such_module_xyz.Thing" and again.state == {"a": 1}
    assert not again.called


def test_global_names_that_would_inject_opcodes_are_refused_when_writing():
    """STACK_GLOBAL names are any string; one with a newline must not reach a GLOBAL line."""
    from ckptkit.decoding.unpickler import OBJECT_GLOBALS, safe_loads
    from ckptkit.ops.writers import torch_save

    hostile = b"\x80\x04\x8c\x05a\nb\nc\x8c\x01X\x93)\x81."
    thing = safe_loads(hostile, allow=OBJECT_GLOBALS, source="x", unknown="opaque")
    with pytest.raises(ckptkit.UnsafePickleError, match="not a dotted Python name"):
        torch_save.dumps({"thing": thing})
