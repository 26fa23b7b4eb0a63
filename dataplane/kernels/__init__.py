"""dataplane/kernels"""
