"""Warp-specialised Gluon kernels for sm_90 (Hopper): ``decode`` and ``prefill``, and what they share (``common``).

Gluon ships with triton as an experimental API and has no interpreter: these run on an sm_90 GPU only, and
``common.runs_on`` says where. Each takes a subset of the calls the portable Triton kernel takes, under the same
contract, tested against the same fp64 oracle.
"""
