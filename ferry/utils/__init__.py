"""Helpers several layers share: ports, process lifetime, integer arithmetic. Imports nothing of ferry."""
