"""The ``torch`` backend's fast kernel (``sdpa``): append in place, then attend with PyTorch's
``scaled_dot_product_attention``. The backend's catch-all is the plain-PyTorch statement of the contract,
``flashcore/reference.py``.
"""
