"""Packed kernel arguments (kvstore.gpu.launch): the bytes the driver reads, on any machine."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvstore.gpu.launch import PackedLaunch, function_pointer


def _slot(launch: PackedLaunch, i: int) -> bytes:
    return ctypes.string_at(launch._params[i], 8)


def test_each_argument_is_packed_in_its_own_8_byte_slot_as_the_kernel_reads_it():
    launch = PackedLaunch(
        0x1234, (3, 2), (256,), 4096, (np.uint64(0xDEADBEEF00), np.int32(-2), np.float32(1.5), np.int64(2**40))
    )
    assert launch.grid == (3, 2, 1) and launch.block == (256, 1, 1) and launch.smem == 4096
    assert _slot(launch, 0) == np.uint64(0xDEADBEEF00).tobytes()
    assert _slot(launch, 1)[:4] == np.int32(-2).tobytes()
    assert _slot(launch, 2)[:4] == np.float32(1.5).tobytes()
    assert _slot(launch, 3) == np.int64(2**40).tobytes()
    launch.set_pointers((0, 3), (0x7000, 0x8000))
    assert _slot(launch, 0) == np.uint64(0x7000).tobytes() and _slot(launch, 3) == np.uint64(0x8000).tobytes()
    assert _slot(launch, 1)[:4] == np.int32(-2).tobytes()  # the others are untouched


def test_arguments_wider_than_a_slot_are_refused():
    with pytest.raises(TypeError, match="wider than 8 bytes"):
        PackedLaunch(1, (1,), (1,), 0, (np.complex128(1j),))


def test_the_function_handle_is_read_from_the_kernel_object_or_its_wrapper():
    class Function:
        ptr = 0x55

    class Kernel:
        kernel = Function()

    assert function_pointer(Kernel()) == 0x55
    assert function_pointer(Function()) == 0x55
    assert function_pointer(object()) is None
