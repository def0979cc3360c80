"""offpolicy.kernels"""
