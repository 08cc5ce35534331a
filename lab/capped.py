"""
The memory-cap protocol the lab's capped runs share (lab/bench.py --memory-table, lab/trl_bench.py
--config qwen-capped, lab/recipes/headline.sh): a smaller card is played on a large GPU by holding
all of its free memory but CAP GiB in one tensor (the hog), giving vLLM the share of this GPU that
gives it the memory its share gave it where the figures were set, and reading the device's peak
from here.

    hog = hold_all_but(45)                            # an L40S's usable ~45 GiB left free
    share = share_here(0.17)                          # 0.17 of an 80 GB H100; 0.096 of an H200
    with PeakMemory() as peak: run(...)               # peak.peak: device-wide bytes used

headline.sh's capped() is the same protocol in shell (a second process holds the hog there).
Only torch: the recipe reads share_here without loading the course.
"""
import threading

import torch

H100_GIB = 79.18  # torch's total memory of an 80 GB H100 (81,079 MiB): the GPU every capped share was set on


def share_here(h100_share: float, total: int | None = None) -> float:
    """The share of this GPU (total bytes; default: torch's) that gives vLLM the memory h100_share gives
    it on an 80 GB H100, where every capped figure was measured: 0.17 there (13.5 GiB, the l40s preset's
    0.3 of a 45 GiB L40S) is 0.096 of a 141 GB H200, where 0.17 itself would leave the trainer short
    under the cap."""
    total = torch.cuda.mem_get_info()[1] if total is None else total
    return round(h100_share * H100_GIB * 2**30 / total, 3)


def hold_all_but(cap_gib: float) -> torch.Tensor:
    """The hog: a tensor holding all of this GPU's free memory but cap_gib GiB, kept while it lives. Make
    this process's CUDA context first (torch.empty(1, device="cuda")) so that the hog is sized after it;
    an error naming both figures when no more than cap_gib GiB are free."""
    free, _ = torch.cuda.mem_get_info()
    if free <= cap_gib * 2**30:
        raise SystemExit(f"error: {free / 2**30:.1f} GiB free, not more than the {cap_gib} GiB cap")
    return torch.empty(int(free - cap_gib * 2**30), dtype=torch.uint8, device="cuda")


class PeakMemory:
    """Device-wide used memory, polled in a thread (cudaMemGetInfo sees vLLM's pool and torch's)."""

    def __init__(self, every_s=0.01):
        self.peak, self.every_s, self._stop = 0, every_s, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(self.every_s)  # returns at once when the block ends

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
