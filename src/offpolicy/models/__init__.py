"""offpolicy.models"""
