"""The float model's outputs on the first calibration batches, kept for the output check.

Calibration runs the float model on its first batches anyway; fetching the model's
outputs there too gives the output check (`emit/fidelity.py`) its float reference without
a second session of the float model (ResNet-20: a session and eight single-sample runs
less). The calibration model is the user's after the function-preserving passes (BatchNorm
folding, CLE, SmoothQuant), at the basic optimisation level: its outputs match the float
model's to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The captured outputs and feeds are held up to this many bytes (at least one sample), as
# the output check's own float reference is (`emit/fidelity.REFERENCE_BYTES`).
CAPTURE_BYTES = 64 << 20


@dataclass
class CapturedOutputs:
    """The outputs `names` on the first calibration batches, with their feeds, until
    `wanted` samples or `CAPTURE_BYTES` are held."""

    names: list[str]
    wanted: int
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)
    outputs: list[list[np.ndarray]] = field(default_factory=list)
    samples: int = 0
    held: int = 0
    complete: bool = False  # every sample of the data is held (the data ran out before `wanted`)
    full: bool = False  # a batch that could not be cut did not fit: nothing more is kept
    # the byte budget, not the samples wanted, ended the capture: a float session of the
    # check's own would hold no more samples (`emit/fidelity.REFERENCE_BYTES`, the same bytes)
    spent: bool = False

    @property
    def wanting(self) -> bool:
        return not self.full and self.samples < self.wanted and self.held < CAPTURE_BYTES

    def add(self, feed: dict[str, np.ndarray], outputs: list[np.ndarray], samples: int, rows: int,
            cuttable: bool = True) -> None:
        """Keep one batch of `samples` samples (`rows` rows). Where every feed and output is
        batched on axis 0, it is cut to the samples still wanted and to the bytes left (at
        least one sample), and the cut is copied: a view would hold the whole batch. A batch
        that cannot be cut (an array not batched on axis 0; `cuttable` False: inputs batched
        on another axis, whose axis 0 may hold as many rows by chance) is kept whole only as
        the first one, and past the bytes left it ends the capture (the check then runs the
        float model for the samples it lacks)."""
        arrays = [*feed.values(), *outputs]
        size = sum(np.asarray(a).nbytes for a in arrays)
        keep = min(self.wanted - self.samples, max(1, (CAPTURE_BYTES - self.held) * samples // max(size, 1)))
        cuttable = cuttable and all(np.ndim(a) and np.shape(a)[0] == rows for a in arrays)
        if not cuttable and self.samples and self.held + size > CAPTURE_BYTES:
            self.full = self.spent = True
            return
        self.spent = self.spent or keep < min(samples, self.wanted - self.samples)
        if keep < samples and cuttable:
            cut = keep * (rows // samples)
            feed = {k: np.array(v[:cut]) for k, v in feed.items()}
            outputs = [np.array(o[:cut]) for o in outputs]
            samples, size = keep, sum(np.asarray(a).nbytes for a in [*feed.values(), *outputs])
        self.feeds.append(feed)
        self.outputs.append(outputs)
        self.samples += samples
        self.held += size
        self.spent = self.spent or self.held >= CAPTURE_BYTES

    def finish(self, calibrated: int, exhausted: bool) -> None:
        """Calibration read `calibrated` samples, all the data had where `exhausted` (no
        sample or batch limit stopped it): a capture of them all is then complete, so a check
        that asks more samples than the data has needs no float session of its own."""
        self.complete = exhausted and self.samples >= calibrated
