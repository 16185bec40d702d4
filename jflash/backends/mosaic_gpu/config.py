"""Tile sizes and pipeline depth of the Hopper kernels."""

from __future__ import annotations

import dataclasses


_SWITCHES = ("fuse_dq", "overlap_sdp", "qk_after_pv")
# Fields read only with fuse_dq=True, and only with fuse_dq=False.
_FUSED_ONLY = ("dq_slots",)
_DQ_PASS_ONLY = ("block_q_dq", "block_kv_dq", "stages_dq")


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
  """Block sizes of the ``mosaic_gpu`` kernels.

  ``None`` fields take the value of :func:`default_config` for the call's
  head dim.  The forward runs two consumer warpgroups per CTA, each owning
  ``block_q`` query rows (so a CTA covers ``2 * block_q`` rows), and a
  producer warpgroup streaming ``block_kv`` keys per step through a ring of
  ``stages`` shared-memory buffers.  The backward passes have their own
  tiles: dQ keeps ``block_q_dq`` query rows per warpgroup and streams
  ``block_kv_dq`` keys; dK/dV keeps ``block_kv_dkv`` keys per warpgroup and
  streams ``block_q_dkv`` queries (at head dim 256 both warpgroups share
  their keys, one accumulating dK and the other dV).  A field of a pass
  that does not run (the dQ pass fields with ``fuse_dq=True``,
  ``dq_slots`` without it) must be left at its default; another value
  raises ``ValueError`` when the configuration is resolved.

  Attributes:
    block_q: forward query rows per consumer warpgroup (multiple of 64).
    block_kv: forward keys per step (multiple of 64).
    stages: forward K/V ring depth (at least 2).
    block_q_dq, block_kv_dq: dQ pass tiles (multiples of 64).
    block_q_dkv, block_kv_dkv: dK/dV pass tiles (multiples of 64).
    stages_dq, stages_dkv: ring depths of the dQ and dK/dV passes (at
      least 1; 1 loads the next tile only after the current one is
      consumed).
    qk_after_pv: in the forward, issue each step's
      next ``Q K^T`` right behind its ``P V`` within the consumer's turn
      and wait for both together, so that the tensor cores do not drain
      between the two; off, ``Q K^T`` is issued once ``P V`` has finished.
    fuse_dq: form dQ inside the dK/dV pass, adding each key block's
      contribution into a float32 accumulator in a fixed order
      (:mod:`~jflash.backends.mosaic_gpu.backward_fused`): five tile
      products per tile instead of seven.  Head dims up to 128.
    overlap_sdp: in every backward pass, issue a step's ``S`` and ``dP``
      products together and form ``P`` while ``dP`` is computed, instead of
      waiting for each in turn (more registers live at once).  Head dims
      up to 128 (at 256 each dK/dV warpgroup forms only one of them), and
      not with ``stages_dq=1``, whose dQ pass computes ``dP`` first.  On by
      default at head dims up to 128 without segment ids or a soft cap.
    dq_slots: how many float32 dQ accumulators the fused backward adds
      into (at least 1).  Key block ``j`` adds into accumulator
      ``j % dq_slots``, in key-block order within each, and the
      accumulators are summed after the kernel, so the result stays
      deterministic.  With one accumulator the CTA of key block ``j`` waits
      about ``j`` steps for its first turn; with ``n`` it waits about
      ``j / n``.  Each accumulator takes ``4 * B * T * N * H`` bytes of
      device memory.  Only read when ``fuse_dq`` is set.
  """

  block_q: int | None = None
  block_kv: int | None = None
  stages: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  block_q_dkv: int | None = None
  block_kv_dkv: int | None = None
  stages_dq: int | None = None
  stages_dkv: int | None = None
  fuse_dq: bool | None = None
  dq_slots: int | None = None
  overlap_sdp: bool | None = None
  qk_after_pv: bool | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if field.name in _SWITCHES:
        if not isinstance(value, bool):
          raise ValueError(f"MosaicGpuConfig.{field.name} must be a bool or "
                           f"None, got {value!r}")
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"MosaicGpuConfig.{field.name} must be an int or "
                         f"None, got {value!r}")
      if field.name == "dq_slots":
        if value < 1:
          raise ValueError(f"MosaicGpuConfig.dq_slots must be at least 1, "
                           f"got {value}")
      elif field.name.startswith("stages"):
        least = 2 if field.name == "stages" else 1
        if value < least:
          raise ValueError(f"MosaicGpuConfig.{field.name} must be at least "
                           f"{least}, got {value}")
      elif value <= 0 or value % 64:
        raise ValueError(f"MosaicGpuConfig.{field.name} must be a positive "
                         f"multiple of 64, got {value}")

  def resolved(self, head_dim: int, kv_len: int | None = None, *,
               soft_cap: bool = False, segments: bool = False,
               causal: bool = False,
               window: tuple[int, int] | None = None) -> "MosaicGpuConfig":
    """Every ``None`` field filled from :func:`default_config` for the head
    dim, (when given) the number of keys, and the features in use.

    With ``fuse_dq`` left to the default, setting any field of the
    separate dQ pass selects the two-pass backward; with ``overlap_sdp``
    left to the default, ``stages_dq=1`` turns it off.

    Raises:
      ValueError: ``fuse_dq`` or ``overlap_sdp`` at a head dim above 128,
        ``overlap_sdp`` with ``stages_dq=1``, or a field set to a
        value other than its default for a pass the configuration does not
        run (``dq_slots`` without the fused backward; the dQ pass fields
        with it).
    """
    base = default_config(head_dim, kv_len, soft_cap=soft_cap,
                          segments=segments, causal=causal, window=window)
    if (self.fuse_dq is None and base.fuse_dq
        and any(getattr(self, name) is not None for name in _DQ_PASS_ONLY)):
      # Tiles given for the separate dQ pass choose the two-pass backward,
      # so that a configuration valid at one length stays valid at another.
      base = dataclasses.replace(base, fuse_dq=False)
    if self.overlap_sdp is None and self.stages_dq == 1:
      # A one-buffer dQ pass computes dP before S, so nothing is issued
      # together: a caller asking for it gets the plain order by default.
      base = dataclasses.replace(base, overlap_sdp=False)
    config = dataclasses.replace(base, **{
        f.name: getattr(self, f.name) for f in dataclasses.fields(self)
        if getattr(self, f.name) is not None})
    if config.overlap_sdp and padded_head_dim(head_dim) > 128:
      raise ValueError(f"MosaicGpuConfig.overlap_sdp serves head dims up to "
                       f"128, got head dim {head_dim}")
    if config.overlap_sdp and not config.fuse_dq and config.stages_dq == 1:
      raise ValueError("MosaicGpuConfig.overlap_sdp needs stages_dq of at "
                       "least 2, got stages_dq=1 (a one-buffer dQ pass "
                       "computes dP before S)")
    if config.fuse_dq and padded_head_dim(head_dim) > 128:
      raise ValueError(f"MosaicGpuConfig.fuse_dq serves head dims up to 128, "
                       f"got head dim {head_dim}")
    # A value other than the default for a pass that does not run would be
    # dropped without effect: refuse it.  (Copies of a default row, e.g.
    # ``dataclasses.replace(default_config(h), ...)``, carry every field,
    # with the table's value or the one a rule gives at this length.)
    table = tuned_config(head_dim, kv_len)
    unused = _FUSED_ONLY if not config.fuse_dq else _DQ_PASS_ONLY
    for name in unused:
      if getattr(self, name) not in (None, getattr(base, name),
                                     getattr(table, name)):
        raise ValueError(
            f"MosaicGpuConfig.{name}={getattr(self, name)!r} has no effect "
            + f"with fuse_dq={config.fuse_dq}: "
            + ("it sets the fused backward, which fuse_dq=True selects"
               if not config.fuse_dq else
               "it sets the separate dQ pass, which the fused backward "
               "replaces"))
    return config


# Per padded head dim, from benchmarks/tune_mosaic_gpu.py (the measurements
# behind each default: benchmarks/results/mosaic-gpu-defaults/README.md).
# Shared memory bounds the forward ring: Q takes 2 * block_q * H * 2 bytes,
# each stage 2 * block_kv * H * 2 bytes, out of 227 KiB.
_DEFAULTS = {
    # qk_after_pv at head dim 128 only: at 64 the 256-key tile leaves no
    # registers for S, P and O in flight at once (ptxas serializes wgmma).
    64: MosaicGpuConfig(block_q=64, block_kv=256, stages=3, block_q_dq=64,
                        block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64,
                        stages_dq=2, stages_dkv=2,
                        fuse_dq=False, dq_slots=4, overlap_sdp=True,
                        qk_after_pv=False),
    128: MosaicGpuConfig(block_q=64, block_kv=128, stages=2, block_q_dq=64,
                         block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64,
                         stages_dq=2, stages_dkv=2,
                         fuse_dq=False, dq_slots=4, overlap_sdp=True,
                         qk_after_pv=True),
    256: MosaicGpuConfig(block_q=64, block_kv=64, stages=2, block_q_dq=64,
                         block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
                         stages_dq=1, stages_dkv=2,
                         fuse_dq=False, dq_slots=4, overlap_sdp=False,
                         qk_after_pv=False),
}


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels run at: 64, 128 or 256."""
  for size in (64, 128, 256):
    if head_dim <= size:
      return size
  raise ValueError(f"head dim {head_dim} is above 256")


# Feature rules, per padded head dim: key tiles narrowed so that the
# kernels keep their tiles in registers (a soft cap's derivative tile in the
# dQ step; segment ids of a 256-key forward tile spill at head dim 64).
_SOFT_CAP_MAX_BLOCK_KV_DQ = {64: 128, 128: 64, 256: 64}
_SEGMENTS_MAX_BLOCK_KV = {64: 128, 128: 256, 256: 256}
# overlap_sdp is off with segment ids (slower there) and with a soft cap
# (whose derivative tile needs the registers).

# The fused backward (five tile products instead of seven) pays for itself
# once every query sees many keys, so that the fixed-order dQ accumulation
# rarely makes a CTA wait; masks whose visible keys move with the query
# (windows; causal beyond 32768 keys, where the accumulators' memory
# grows) keep the two-pass backward, as do the unmeasured soft caps and
# segment ids.  Under a causal mask the key blocks wait on each other in
# a wavefront with one accumulator: more accumulators break it up.
# Without and with a causal mask, per padded head dim: (fewest keys, most
# keys or None, fields set with fuse_dq), or None.
_FUSED_RULES: dict[bool, dict[int, tuple[int, int | None, dict] | None]] = {
    False: {64: (4096, None, dict(block_q_dkv=128, overlap_sdp=False,
                                  dq_slots=2)),
            128: (4096, None, {}),
            256: None},
    True: {64: (4096, 32768, dict(block_q_dkv=128, overlap_sdp=False,
                                  dq_slots=4)),
           128: (4096, 32768, dict(dq_slots=2)),
           256: None},
}


def tuned_config(head_dim: int, kv_len: int | None = None
                 ) -> MosaicGpuConfig:
  """The tuned table alone for a head dim (padded to 64, 128 or 256): its
  row with the narrowing of key tiles to ``kv_len`` when given (see
  :func:`default_config`).  This is what
  ``benchmarks/tune_mosaic_gpu.py`` starts from and prints; the measured
  rules of :func:`default_config` come on top."""
  padded = padded_head_dim(head_dim)
  return _narrowed(_DEFAULTS[padded], kv_len, {})


def default_config(head_dim: int, kv_len: int | None = None, *,
                   soft_cap: bool = False,
                   segments: bool = False,
                   causal: bool = False,
                   window: tuple[int, int] | None = None) -> MosaicGpuConfig:
  """The configuration a call gets by default for a head dim (padded to 64,
  128 or 256), adjusted to the number of keys ``kv_len`` when given and to
  the features in use.

  Rules, in order:

  * the tuned table (:func:`tuned_config`);
  * the fused backward (``fuse_dq``) at head dims 64 and 128 from 4096
    keys (``kv_len``) without a ``window``, a soft cap or segment ids:
    when every query sees the same keys (not ``causal``) with one dQ
    accumulator at head dim 128 and two at head dim 64; ``causal`` up to
    32768 keys with two at head dim 128 and four at head dim 64; at head
    dim 64 always with 128-query dK/dV tiles and ``overlap_sdp`` off;
  * features: with ``soft_cap`` the dQ key tile is at most 64 at head
    dims 128 and 256; with ``segments`` the forward key tile is at most
    128 at head dim 64; with either, ``overlap_sdp`` and ``qk_after_pv``
    are off;
  * no key tile of the forward or the dQ pass is wider than the keys.  A
    tile is narrowed to the smallest of 64, 128 and 256 that covers
    ``kv_len`` (so that short sequences, e.g. 77 keys at head dim 64, do
    not compute a 256-key tile for 77 keys); powers of two keep every
    pass's tile a divisor of the padded length.
  """
  padded = padded_head_dim(head_dim)
  config = _DEFAULTS[padded]
  rule = _FUSED_RULES[bool(causal)][padded]
  if (kv_len is not None and rule is not None and not (soft_cap or segments)
      and window is None and kv_len >= rule[0]
      and (rule[1] is None or kv_len <= rule[1])):
    config = dataclasses.replace(
        config, **{"fuse_dq": True, "dq_slots": 1, **rule[2]})
  if config.overlap_sdp and (soft_cap or segments):
    config = dataclasses.replace(config, overlap_sdp=False)
  if config.qk_after_pv and (soft_cap or segments):
    config = dataclasses.replace(config, qk_after_pv=False)
  widest = {}
  if soft_cap:
    widest["block_kv_dq"] = _SOFT_CAP_MAX_BLOCK_KV_DQ[padded]
  if segments:
    widest["block_kv"] = _SEGMENTS_MAX_BLOCK_KV[padded]
  return _narrowed(config, kv_len, widest)


def _narrowed(config: MosaicGpuConfig, kv_len: int | None,
              widest: dict[str, int]) -> MosaicGpuConfig:
  """``config`` with key tiles no wider than ``widest`` gives, nor than the
  smallest of 64, 128, 256 covering ``kv_len``."""
  widest = dict(widest)
  if kv_len is not None:
    cover = 64
    while cover < kv_len:
      cover *= 2
    for name in ("block_kv", "block_kv_dq"):
      widest[name] = min(cover, widest.get(name, cover))
  narrowed = {name: width for name, width in widest.items()
              if width < getattr(config, name)}
  return dataclasses.replace(config, **narrowed) if narrowed else config
