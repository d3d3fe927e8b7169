"""The I/O engine on real files: O_DIRECT on the local disk, a tiny tmpfs for ENOSPC, truncation."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from lightning_greedysnake.io import (
    ALIGN_BYTES,
    AlignedBuffer,
    IOConfig,
    OffloadIOError,
    ShortReadError,
    ThreadedIOEngine,
    open_offload_file,
)
from lightning_greedysnake.offload import probe_o_direct
from tests.helpers import mounted

MiB = 1 << 20


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("greedysnake-io")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_buffers_are_page_aligned():
    with AlignedBuffer(10_000) as buf:
        assert buf.nbytes == 12_288
        assert buf.tensor.data_ptr() % ALIGN_BYTES == 0
        assert int(buf.tensor.sum()) == 0


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_large_buffers_ask_for_transparent_huge_pages():
    """A buffer of a huge page or more is advised MADV_HUGEPAGE (the mapping's ``hg`` flag), so that
    O_DIRECT pins and maps 2 MiB pages (the kernel grants them where THP is ``always`` or ``madvise``);
    a small one is left to the kernel's default."""
    with AlignedBuffer(4 * MiB) as large, AlignedBuffer(64 << 10) as small:
        assert "hg" in vm_flags(large.tensor.data_ptr())
        assert "hg" not in vm_flags(small.tensor.data_ptr())


def test_round_trip_in_chunks_with_o_direct(tmp_path):
    fds_before = open_fds()
    payload = torch.randint(0, 256, (5 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with ThreadedIOEngine(IOConfig(num_threads=3, chunk_bytes=MiB)) as io:
        file = io.open(tmp_path / "unit0.bin", 6 * MiB)
        assert file.direct  # ext4 on the test machines supports O_DIRECT
        assert (os.stat(file.path).st_mode & 0o777) == 0o600
        src, dst = AlignedBuffer(5 * MiB), AlignedBuffer(5 * MiB)
        src.tensor.copy_(payload)
        io.write(file, MiB, src, 0, 5 * MiB)
        io.read(file, MiB, dst, 0, 5 * MiB)
        assert torch.equal(dst.tensor, payload)
        # a window in the middle, at an aligned offset
        part = AlignedBuffer(2 * MiB)
        io.read(file, 2 * MiB, part, 0, 2 * MiB)
        assert torch.equal(part.tensor, payload[MiB : 3 * MiB])
        assert io.bytes_written == 5 * MiB and io.bytes_read == 7 * MiB
        assert len(io_threads()) > 0
        for b in (src, dst, part):
            b.close()
    assert io_threads() == []
    assert open_fds() == fds_before


def test_unaligned_requests_are_refused(tmp_path):
    with ThreadedIOEngine() as io, AlignedBuffer(8192) as buf:
        file = io.open(tmp_path / "f.bin", 8192)
        with pytest.raises(ValueError, match="offset=100"):
            io.read(file, 100, buf, 0, 4096)
        with pytest.raises(ValueError, match="past the end"):
            io.read(file, 4096, buf, 0, 8192)


def test_truncated_file_is_a_short_read_naming_file_and_offset(tmp_path):
    with ThreadedIOEngine() as io, AlignedBuffer(3 * 4096) as buf:
        file = io.open(tmp_path / "trunc.bin", 3 * 4096)
        os.truncate(file.path, 4096)
        with pytest.raises(ShortReadError, match=r"offset 0 in .*trunc\.bin got only 4096"):
            io.read(file, 0, buf, 0, 3 * 4096)


def test_buffered_fallback_when_o_direct_is_refused(tmp_path):
    """Filesystems that refuse O_DIRECT (EINVAL at open; tmpfs before Linux 6.6) get buffered I/O and
    one warning. This kernel's tmpfs accepts O_DIRECT, so the refusal is injected at open()."""

    def refusing_open(path: str, flags: int, mode: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.open(path, flags, mode)

    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
        file = open_offload_file(tmp_path / "a.bin", 4096, direct=True, opener=refusing_open)
    try:
        assert not file.direct
    finally:
        file.close()


def test_buffered_fallback_on_a_real_filesystem_without_o_direct(tmp_path):
    """ramfs really refuses O_DIRECT: one warning, buffered I/O, and the data round-trips."""
    with mounted(tmp_path / "ram", fstype="ramfs") as mount:
        with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
            file = open_offload_file(mount / "a.bin", 2 * 4096, direct=True)
        with ThreadedIOEngine(IOConfig(num_threads=2, chunk_bytes=4096)) as engine, AlignedBuffer(8192) as buf:
            buf.tensor.copy_(torch.arange(8192, dtype=torch.int32).to(torch.uint8))
            engine.write(file, 0, buf, 0, 8192)
            with AlignedBuffer(8192) as back:
                engine.read(file, 0, back, 0, 8192)
                assert torch.equal(back.tensor, buf.tensor)
        assert not file.direct
        file.close()
        assert not probe_o_direct(mount)


def test_full_filesystem_fails_up_front_with_enospc(tmp_path):
    with mounted(tmp_path / "tiny", size="4M") as mount, ThreadedIOEngine() as io:
        with pytest.raises(OffloadIOError, match=r"preallocate of .* in .*big\.bin failed.*full") as info:
            io.open(mount / "big.bin", 16 * MiB)
        assert info.value.errno == errno.ENOSPC


def test_config_errors():
    with pytest.raises(ValueError, match="num_threads=0"):
        IOConfig(num_threads=0)
    with pytest.raises(ValueError, match="chunk_bytes=1000"):
        IOConfig(chunk_bytes=1000)
