"""Glue of the example app (``plans/example-app``): the detector's boxes cropped into classifier inputs.

The glue contract
-----------------
:mod:`ppiped.query.glue`'s, the one calling form of the daemon's glue workers and of the by-hand
runner (:class:`ppiped.query.local.LocalApp`)::

    crop(outputs, frame, spec) -> list of child inputs

* ``outputs``: the detector's outputs for one request, a list of numpy arrays in the model's
  output order with the batch axis removed (here ``heat`` ``[1, G, G]`` and ``boxes``
  ``[4, G, G]``). A dict name -> array is accepted too, for calls by hand.
* ``frame``: the client's original frame, a numpy array with the root model's input shape
  (no batch axis; here ``[3, 128, 128]`` float32 in [0, 1]), or its raw bytes as a flat
  ``uint8`` array (where the daemon does not know the root model's input).
* ``spec``: a :class:`ppiped.query.glue.GlueSpec`, which :func:`crop` does not need.
* The result: a list of inputs for the child stage, one numpy array per child request, each
  with the child model's input shape (no batch axis) and dtype; an empty list when nothing was
  found. It must be a pure function of its arguments (workers run any query's calls).

Numpy only, so a glue worker imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FRAME_SHAPE = (3, 128, 128)  # the detector's input (the app's frame)
CROP_SHAPE = (3, 32, 32)  # the classifier's input
CROP_DTYPE = np.dtype(np.float32)
OUTPUT_NAMES = ("heat", "boxes")  # the detector's outputs, in model order
THRESHOLD = 0.5  # objectness a cell needs to make a box
IOU_MAX = 0.3  # a box overlapping a stronger one more than this is the same object
TOP_K = 8  # at most this many crops per frame (the strongest)


def _outputs(parent_outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(parent_outputs, Mapping):
        heat, boxes = (parent_outputs[n] for n in OUTPUT_NAMES)
    else:
        heat, boxes = parent_outputs[0], parent_outputs[1]
    heat = np.asarray(heat, dtype=np.float32)
    boxes = np.asarray(boxes, dtype=np.float32)
    grid = heat.shape[-2:]
    return heat.reshape(grid), boxes.reshape(4, *grid)


def _iou_matrix(b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of boxes (x0, y0, x1, y1), one per row."""
    w = np.clip(np.minimum(b[:, None, 2], b[None, :, 2]) - np.maximum(b[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(b[:, None, 3], b[None, :, 3]) - np.maximum(b[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area[:, None] + area[None, :] - inter, 1e-6)


def decode(parent_outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
           frame_hw: tuple[int, int] = FRAME_SHAPE[1:]) -> list[tuple[float, float, float, float, float]]:
    """Boxes (x0, y0, x1, y1, score) in frame pixels, strongest first: cells over the threshold,
    greedy non-maximum suppression by IoU, at most ``TOP_K``. Ties break by cell order, so the
    result is a function of the outputs alone."""
    heat, boxes = _outputs(parent_outputs)
    score = heat.ravel()
    cand = np.flatnonzero(score > THRESHOLD)
    if cand.size == 0:
        return []
    cand = cand[np.argsort(-score[cand], kind="stable")]
    cx, cy, w, h = (boxes[k].ravel()[cand] for k in range(4))
    H, W = frame_hw
    xyxy = np.stack([np.clip(cx - w / 2, 0, W), np.clip(cy - h / 2, 0, H),
                     np.clip(cx + w / 2, 0, W), np.clip(cy + h / 2, 0, H)], axis=1)
    iou = _iou_matrix(xyxy)
    alive = (xyxy[:, 2] - xyxy[:, 0] >= 1) & (xyxy[:, 3] - xyxy[:, 1] >= 1)  # not outside the frame
    keep: list[int] = []
    for i in range(len(cand)):
        if not alive[i]:
            continue
        keep.append(i)
        if len(keep) == TOP_K:
            break
        alive &= iou[i] <= IOU_MAX
    return [(*(float(v) for v in xyxy[i]), float(score[cand[i]])) for i in keep]


def resize_crop(frame: np.ndarray, box: Sequence[float], size: tuple[int, int] = CROP_SHAPE[1:]) -> np.ndarray:
    """The box ``(x0, y0, x1, y1)`` of a CHW frame resampled bilinearly to ``size`` (pixel centres
    aligned, edges clamped): what a resize of the crop would give, without an image library."""
    x0, y0, x1, y1 = (float(v) for v in box[:4])
    oh, ow = size
    _, H, W = frame.shape
    ys = np.clip(y0 + (np.arange(oh) + 0.5) * (y1 - y0) / oh - 0.5, 0, H - 1)
    xs = np.clip(x0 + (np.arange(ow) + 0.5) * (x1 - x0) / ow - 0.5, 0, W - 1)
    yi = np.minimum(ys.astype(np.int64), H - 2)
    xi = np.minimum(xs.astype(np.int64), W - 2)
    fy = (ys - yi)[None, :, None]
    fx = (xs - xi)[None, None, :]
    f = frame.astype(np.float32, copy=False)
    tl = f[:, yi][:, :, xi]
    tr = f[:, yi][:, :, xi + 1]
    bl = f[:, yi + 1][:, :, xi]
    br = f[:, yi + 1][:, :, xi + 1]
    top = tl + (tr - tl) * fx
    bot = bl + (br - bl) * fx
    return (top + (bot - top) * fy).astype(CROP_DTYPE)


def _frame(frame: Any) -> np.ndarray:
    a = np.asarray(frame)
    if a.shape == FRAME_SHAPE:
        return a
    if a.ndim == 1 and a.nbytes == int(np.prod(FRAME_SHAPE)) * 4:  # raw bytes of a float32 frame
        return a.view(np.float32).reshape(FRAME_SHAPE)
    raise ValueError(f"example_glue.crop takes a frame of shape {list(FRAME_SHAPE)} float32, "
                     f"got {list(a.shape)} {a.dtype}")


def crop(parent_outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray], frame: np.ndarray,
         spec: Any = None) -> list[np.ndarray]:
    """The classifier's inputs for one detector request: each decoded box cropped from the frame
    and resized to ``CROP_SHAPE`` (see the module docstring for the contract)."""
    f = _frame(frame)
    return [resize_crop(f, b) for b in decode(parent_outputs, f.shape[1:])]
