"""learner"""
