"""The portable Triton kernels: the append-and-attend body (``attention``), its tile helpers (``tiles``), the shared
protocol (``split_merge``: the seq_lens ticket and the split-KV merge), the decoder layer's pointwise kernels
(``layer_kernels``) and its projections' one-row GEMV (``gemv``) and few-row GEMM (``rows_gemm``). They run on any
CUDA GPU Triton supports, and on the CPU under ``TRITON_INTERPRET=1``.
"""
