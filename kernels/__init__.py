"""Triton kernels of FlowEngine, imported as ``flowengine.kernels``."""
