"""dataplane/sglang"""
