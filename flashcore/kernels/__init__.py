"""Triton kernels and their thin launchers; no validation or allocation policy lives here."""
