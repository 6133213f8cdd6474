"""Cython core of byteps: transport, pipeline and summation kernels."""
