"""Fuzzing the parsers of untrusted bytes with mutated real inputs: the safe unpickler, the zip
record parser and the safetensors header parser. Whatever the bytes, only ckptkit errors come
out: no other exception type, no hang (an alarm per example), no huge allocation (tracemalloc
peak per example)."""

from __future__ import annotations

import os
import signal
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.decoding.pickle_limits import METADATA_LIMITS, RECORD_LIMITS
from ckptkit.decoding.records import (
    TorchArchive,
    decode_object_record,
    decode_tensor_record,
    parse_safetensors_header,
    safetensors_header_length,
    zip_members,
)
from ckptkit.decoding.unpickler import OBJECT_GLOBALS, TENSOR_GLOBALS, safe_loads
from ckptkit.formats.parts.dcp_metadata import ALLOWED_GLOBALS as DCP_GLOBALS

FIXTURES = Path(__file__).parent / "fixtures"
DCP_DIR = FIXTURES / "olmo_torch_new_ws2" / "step3" / "model_and_optim"
UNSHARDED = FIXTURES / "olmo_unsharded" / "step3-unsharded-safetensors"
TIMEOUT_S = 10
PEAK_BYTES = 256 << 20
#: CKPTKIT_FUZZ_EXAMPLES=5000 runs a longer, randomized session locally.
EXAMPLES = int(os.environ.get("CKPTKIT_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the alarm bounds each example; hypothesis' deadline would flake under load
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize="CKPTKIT_FUZZ_EXAMPLES" not in os.environ,
)


def _records() -> dict[str, bytes]:
    """Real inputs, as torch and OLMo wrote them."""
    ckpt = ckptkit.open(str(DCP_DIR))
    tensor = next(e for e in ckpt.catalog.tensors() if e.chunks[0].record is not None)
    obj = ckpt.catalog.objects()[0]
    out = {}
    for name, entry in (("tensor record", tensor), ("object record", obj)):
        r = entry.chunks[0].record
        out[name] = (DCP_DIR / r.file).read_bytes()[r.offset : r.offset + r.length]
    out["torch.save file"] = (UNSHARDED / "train.pt").read_bytes()
    return out


RECORDS = _records()
METADATA = (DCP_DIR / ".metadata").read_bytes()
TENSOR_PICKLE = bytes(TorchArchive(RECORDS["tensor record"], "x").pickle_bytes())
TRAIN_PICKLE = bytes(TorchArchive(RECORDS["torch.save file"], "x").pickle_bytes())
SAFETENSORS = (UNSHARDED / "model.safetensors").read_bytes()[:65536]


def _mutations(size_hint: int):
    position = st.integers(min_value=0, max_value=max(size_hint - 1, 0))
    return st.lists(
        st.one_of(
            st.tuples(st.just("flip"), position, st.integers(1, 255)),
            st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=16)),
            st.tuples(st.just("delete"), position, st.integers(1, 64)),
            st.tuples(st.just("truncate"), position, st.just(0)),
            st.tuples(
                st.just("number"),
                position,
                st.sampled_from([0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 40, (1 << 64) - 1]),
            ),
        ),
        min_size=1,
        max_size=6,
    )


def _mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, pos, arg in mutations:
        pos = min(pos, len(out))
        if kind == "flip" and pos < len(out):
            out[pos] ^= arg
        elif kind == "insert":
            out[pos:pos] = arg
        elif kind == "delete":
            del out[pos : pos + arg]
        elif kind == "truncate":
            del out[pos:]
        elif kind == "number":
            width = 8 if arg > 0xFFFFFFFF else 4
            out[pos : pos + width] = struct.pack("<Q" if width == 8 else "<I", arg)
    return bytes(out)


def _bounded(fn, *args, **kwargs) -> None:
    """Run ``fn``: a ckptkit error or success is fine; anything else, a hang or a huge
    allocation fails the example."""

    def alarm(signum, frame):
        raise TimeoutError(f"no result after {TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIMEOUT_S)
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
    except ckptkit.CheckpointError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak < PEAK_BYTES, f"peak allocation {peak / 2**20:.0f} MiB"


@FUZZ
@given(mutations=_mutations(len(METADATA)))
def test_fuzz_metadata_pickle(mutations):
    data = _mutate(METADATA, mutations)
    _bounded(safe_loads, data, allow=DCP_GLOBALS, source="fuzz", limits=METADATA_LIMITS)


@FUZZ
@given(
    which=st.sampled_from(["tensor", "train"]),
    mutations=_mutations(2048),
)
def test_fuzz_record_and_object_pickles(which, mutations):
    if which == "tensor":
        data = _mutate(TENSOR_PICKLE, mutations)
        _bounded(safe_loads, data, allow=TENSOR_GLOBALS, source="fuzz", limits=RECORD_LIMITS)
    else:
        data = _mutate(TRAIN_PICKLE, mutations)
        _bounded(safe_loads, data, allow=OBJECT_GLOBALS, source="fuzz", unknown="opaque")


@FUZZ
@given(
    which=st.sampled_from(sorted(RECORDS)),
    mutations=_mutations(4096),
    verify_crc=st.booleans(),
)
def test_fuzz_zip_records(which, mutations, verify_crc):
    data = _mutate(RECORDS[which], mutations)

    def parse() -> None:
        zip_members(memoryview(data), "fuzz")
        if which == "tensor record":
            decode_tensor_record(data, "fuzz", verify_crc=verify_crc)
        else:
            decode_object_record(data, "fuzz", verify_crc=verify_crc)

    _bounded(parse)


@FUZZ
@given(mutations=_mutations(2048))
def test_fuzz_safetensors_header(mutations):
    data = _mutate(SAFETENSORS, mutations)

    def parse() -> None:
        n = safetensors_header_length(data[:8], "fuzz")
        parse_safetensors_header(data[8 : 8 + n], "fuzz")

    _bounded(parse)


def test_the_seeds_parse():
    """The unmutated inputs decode, so the fuzzers start from valid bytes."""
    safe_loads(METADATA, allow=DCP_GLOBALS, source="seed", limits=METADATA_LIMITS)
    decode_tensor_record(RECORDS["tensor record"], "seed", verify_crc=True)
    decode_object_record(RECORDS["object record"], "seed", verify_crc=True)
    n = safetensors_header_length(SAFETENSORS[:8], "seed")
    assert parse_safetensors_header(SAFETENSORS[8 : 8 + n], "seed").tensors


@pytest.mark.parametrize("byte", range(256))
def test_every_single_opcode_after_a_real_prefix(byte):
    """Each possible byte placed right after a real tensor record's header opcodes."""
    data = TENSOR_PICKLE[:2] + bytes([byte]) + TENSOR_PICKLE[2:]
    _bounded(safe_loads, data, allow=TENSOR_GLOBALS, source="fuzz", limits=RECORD_LIMITS)
