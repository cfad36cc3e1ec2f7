"""Stand-ins never do unbounded work while a pickle loads (issue 24, item 1).

A list whose two items are the same list, nested 80 deep, is 241 bytes of pickle and 2**80
leaves when printed. Handed to a stand-in that formats its argument into an error message while
unpickling (numpy's ``_reconstruct``, DCP's memory-format enum, Megatron's restricted
``getattr``, DeepSpeed's ``ZeroStageEnum``, a DCP record's transform descriptors) it used to
hang ``ckptkit.open`` with memory growing. Each case edits the pickle of a real file (written by
torch here, or a checked-in fixture) so the stand-in receives that list, then opens it in a
fresh interpreter under a 1.5 GB address-space limit and a timeout: a typed error (or an open
that reads on), naming the value boundedly. Then :func:`bounded_repr` itself.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from byte_edits import unframed

from ckptkit.decoding.bounded_repr import bounded_repr
from ckptkit.decoding.unpickler import OBJECT_GLOBALS, safe_loads
from ckptkit.errors import PickleLimitError

from conformance_cases import FIXTURES

#: Pickle opcodes building ``x = []`` then ``x = [x, x]`` 80 times: 80 MARKs, EMPTY_LIST, then
#: DUP + LIST per level (no memo, so the edited pickles' memo indices stay as they were).
DEEP = b"(" * 80 + b"]" + b"2l" * 80
#: What an error shows of that list: a few levels, the repeats named.
SHOWN = "[[[[[[[...], <same list>], <same list>]"

#: Opens ``argv[1]`` with at most 1.5 GB of address space; reads ``argv[2]`` when given.
_OPEN_LIMITED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
import ckptkit
out = {}
try:
    ckpt = ckptkit.open(sys.argv[1])
    out["keys"] = sorted(ckpt.keys())
    out["tensors"] = len(ckpt.tensors)
    if len(sys.argv) > 2:
        ckpt.read_numpy(sys.argv[2])
except ckptkit.CheckpointError as exc:
    out.update(error=type(exc).__name__, message=str(exc), cause=repr(exc.__cause__)[:200])
print(json.dumps(out))
"""


def _open_limited(path: Path, *read: str) -> dict:
    """What opening ``path`` (then reading ``read``) gives in a fresh, memory-limited
    interpreter; a hang fails the test at the timeout."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_LIMITED, str(path), *read],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    outcome["seconds"] = time.monotonic() - start
    return outcome


def _edit_member(path: Path, suffix: str, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite the torch.save zip ``path`` with its member ending in ``suffix`` edited."""
    with zipfile.ZipFile(path) as old:
        members = [(info, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for info, content in members:
            new.writestr(info, edit(content) if info.filename.endswith(suffix) else content)


def _sub_once(pattern: bytes, replacement: bytes, data: bytes) -> bytes:
    """``data`` with the one match of ``pattern`` replaced (group 1 kept before ``replacement``)."""
    edited, count = re.subn(
        pattern, lambda m: m.group(1) + replacement, data, count=1, flags=re.DOTALL
    )
    assert count == 1, pattern
    return edited


def _numpy_shape(data: bytes) -> bytes:
    """numpy pickles ``_reconstruct(ndarray, (0,), b'b')``: the shape ``(0,)`` becomes DEEP."""
    return _sub_once(rb"(cnumpy\nndarray\nq.)K\x00\x85", DEEP, data)


_STATE = {"w": torch.ones(3), "a": np.zeros(3, dtype=np.float32)}


def _torch_save_zip(tmp_path: Path) -> Path:
    path = tmp_path / "zip.pt"
    torch.save(_STATE, path)
    _edit_member(path, "/data.pkl", _numpy_shape)
    return path


def _pre16_file(tmp_path: Path) -> Path:
    path = tmp_path / "pre16.pt"
    torch.save(_STATE, path, _use_new_zipfile_serialization=False)
    assert not path.read_bytes().startswith(b"PK")
    path.write_bytes(_numpy_shape(path.read_bytes()))
    return path


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _torchscript_archive(tmp_path: Path) -> Path:
    """A scripted module whose ``training`` flag becomes ``_reconstruct(ndarray, DEEP, b'b')``
    (TorchScript's allowlist holds numpy's globals like any torch.save pickle)."""
    path = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(_Tiny()), path)
    call = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + DEEP + b"C\x01b\x87R"
    # BINUNICODE 'training', BINPUT n, NEWTRUE: the NEWTRUE becomes the call
    _edit_member(
        path, "/data.pkl", lambda data: _sub_once(rb"(X\x08\0\0\0trainingq.)\x88", call, data)
    )
    return path


def _dcp_save(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(3.0)}, checkpoint_id=str(path))
    return path


def _dcp_memory_format(tmp_path: Path) -> Path:
    """``_MEM_FORMAT_ENCODING(0)`` in a torch-written ``.metadata`` called with DEEP."""
    path = _dcp_save(tmp_path)
    data = unframed((path / ".metadata").read_bytes())
    data = _sub_once(rb"(\x8c\x14_MEM_FORMAT_ENCODING\x94\x93\x94)K\x00", DEEP, data)
    (path / ".metadata").write_bytes(data)
    return path


def _megatron_getattr(tmp_path: Path) -> Path:
    """Megatron 0.16's ``getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')`` asking for
    DEEP instead (the MEMOIZE kept, so later memo references still hold)."""
    path = tmp_path / "megatron"
    shutil.copytree(FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint", path)
    data = unframed((path / ".metadata").read_bytes())
    data = _sub_once(
        rb"(h\x00\x8c\x14_MEM_FORMAT_ENCODING\x94\x93\x94)\x8c\x17TORCH_CONTIGUOUS_FORMAT",
        DEEP,
        data,
    )
    (path / ".metadata").write_bytes(data)
    return path


def _deepspeed_zero_stage(tmp_path: Path) -> Path:
    """``ZeroStageEnum(2)`` in a real DeepSpeed optimizer-state file called with DEEP."""
    path = tmp_path / "deepspeed"
    shutil.copytree(FIXTURES / "deepspeed_zero2_ws2" / "checkpoint", path)
    optim = path / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    stage = rb"(cdeepspeed.runtime.zero.config\nZeroStageEnum\nq.)K\x02"
    _edit_member(optim, "/data.pkl", lambda data: _sub_once(stage, DEEP, data))
    return path


#: case → (hostile file maker, error class, what the message says).
CASES: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "torch.save zip: numpy _reconstruct": (
        _torch_save_zip,
        "CorruptRecordError",
        f"numpy array reconstructed with shape {SHOWN}",
    ),
    "pre-1.6 file: numpy _reconstruct": (
        _pre16_file,
        "CorruptRecordError",
        f"numpy array reconstructed with shape {SHOWN}",
    ),
    "TorchScript archive: numpy _reconstruct": (
        _torchscript_archive,
        "CorruptRecordError",
        f"numpy array reconstructed with shape {SHOWN}",
    ),
    "DCP metadata: memory-format code": (
        _dcp_memory_format,
        "CorruptRecordError",
        f"unknown memory-format code {SHOWN}",
    ),
    "Megatron metadata: getattr name": (
        _megatron_getattr,
        "UnsafePickleError",
        "pickle calls builtins.getattr(function, [[[[[[[...], <same list>], <same list...);",
    ),
    "DeepSpeed optimizer state: ZeroStageEnum": (
        _deepspeed_zero_stage,
        "CorruptRecordError",
        f"ZeroStageEnum({SHOWN}",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stand_in_given_a_shared_deep_list_fails_fast_and_small(case, tmp_path):
    make, error, says = CASES[case]
    outcome = _open_limited(make(tmp_path))
    assert outcome.get("error") == error, outcome
    message = outcome["message"]
    assert says in message, message
    assert len(message) < 1000, message
    assert "MemoryError" not in outcome["cause"]
    assert outcome["seconds"] < 30


def test_dcp_record_transform_descriptors_stay_bounded(tmp_path):
    """A ``_StorageInfo`` whose ``transform_descriptors`` holds DEEP: the stand-in names the
    transform boundedly while loading, the checkpoint opens, and reading the tensor is refused
    for that transform."""
    path = _dcp_save(tmp_path)
    data = unframed((path / ".metadata").read_bytes())
    # SHORT_BINUNICODE 'transform_descriptors', [DEEP], set first in the record's state dict
    descriptors = b"\x8c\x15transform_descriptors]" + DEEP + b"a"
    data = _sub_once(rb"(_StorageInfo\x94\x93\x94\)\x81\x94\}\x94\()", descriptors, data)
    (path / ".metadata").write_bytes(data)
    opened = _open_limited(path)
    assert opened["keys"] == ["w"] and opened["tensors"] == 1, opened
    outcome = _open_limited(path, "w")
    assert outcome.get("error") == "CorruptRecordError", outcome
    assert "unsupported record transform" in outcome["message"]
    assert SHOWN in outcome["message"] and len(outcome["message"]) < 1000


# --------------------------------------------------------------------------------------------
# bounded_repr


def _shared_deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value, value]
    return value


def test_small_builtin_values_print_as_repr_does():
    values = [
        (3, 4), (1,), (), [], {}, set(), frozenset(), {1, 2}, frozenset({1}), [1, [2, (3,)]],
        {"a": [1, 2.5], ("k", 1): None}, b"ab\x00", bytearray(b"x"), "it's", 1.5, 2 + 3j,
        True, None, range(3), slice(1, 2, None), 10**50, -5, np.float32(1.5), np.dtype("<f4"),
        collections.OrderedDict(), int,
    ]  # fmt: skip
    for value in values:
        assert bounded_repr(value) == repr(value)


def test_shared_sub_objects_print_once_in_linear_time():
    start = time.monotonic()
    text = bounded_repr(_shared_deep(80))
    assert time.monotonic() - start < 1  # unbounded: 2**80 steps; the margin is for busy CI hosts
    assert text.startswith(SHOWN) and text.count("<same list>") == 6
    pair = (1, 2)
    assert bounded_repr([pair, pair, [pair]]) == "[(1, 2), <same tuple>, [<same tuple>]]"
    assert bounded_repr([[], []]) == "[[], []]"  # empty containers cost nothing: printed


def test_cycles_are_safe():
    loop: list = [1]
    loop.append(loop)
    assert bounded_repr(loop) == "[1, <same list>]"
    table: dict = {"self": None}
    table["self"] = table
    assert bounded_repr(table) == "{'self': <same dict>}"


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("chars", [0, 2, 5, 40, 200, 1000])
def test_output_never_exceeds_the_character_cap(chars):
    huge = [
        "s" * 10**7,
        b"b" * 10**7,
        bytearray(10**6),
        10**20000,
        list(range(10**6)),
        {i: str(i) for i in range(10**5)},
        _shared_deep(200),
        _nested(10**5),
    ]
    for value in huge:
        start = time.monotonic()
        text = bounded_repr(value, chars=chars)
        assert len(text) <= chars, (chars, text)
        assert time.monotonic() - start < 1, type(value)  # ms here; the margin is for busy hosts


def test_depth_and_items_are_capped():
    assert bounded_repr(list(range(100)), items=3) == "[0, 1, 2, ...]"
    assert bounded_repr({i: i for i in range(10)}, items=2) == "{0: 0, 1: 1, ...}"
    assert bounded_repr([[[[1]]]], depth=2) == "[[[...]]]"
    assert bounded_repr("x" * 1000, chars=12) == "'xxxxxxxx..."
    assert bounded_repr(10**5000) == "<int of 16610 bits>"


def test_placeholders_and_tensors_print_within_the_budget():
    """A placeholder for a global outside the allowlist (its arguments are decoded values) and a
    tensor print as their own ``repr`` when small, and stay bounded when their parts are not."""
    import dataclasses
    import fractions
    import pickle

    from ckptkit.decoding.pickle_limits import OBJECT_LIMITS

    data = pickle.dumps(fractions.Fraction(1, 2), protocol=2)
    small = safe_loads(data, allow=OBJECT_GLOBALS, source="x", unknown="opaque")
    assert bounded_repr(small) == repr(small) == "<fractions.Fraction(1, 2)>"
    hostile = data.replace(b"K\x01K\x02", DEEP + b"K\x02", 1)
    assert hostile != data
    with pytest.raises(PickleLimitError, match="shared parts"):  # the value check, after loading
        safe_loads(hostile, allow=OBJECT_GLOBALS, source="x", unknown="opaque")
    unchecked = dataclasses.replace(OBJECT_LIMITS, check_value=False)
    placeholder = safe_loads(
        hostile, allow=OBJECT_GLOBALS, source="x", unknown="opaque", limits=unchecked
    )
    assert bounded_repr(placeholder) == (
        "<fractions.Fraction([[[[[...], <same list>], <same list>], <same list>], <same list>], 2)>"
    )
    tensor = safe_loads(
        _zip_pickle(torch.zeros(2, 3)), allow=OBJECT_GLOBALS, source="x", unknown="opaque"
    )
    assert bounded_repr(tensor) == repr(tensor) == "Tensor(float32, [2, 3])"
    assert len(bounded_repr([tensor] * 100, chars=60)) <= 60


def _zip_pickle(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return archive.read(name)
