"""governance"""
