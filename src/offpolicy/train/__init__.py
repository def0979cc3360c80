"""offpolicy.train"""
