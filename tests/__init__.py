"""The tests of the runtime's later parts and of what serves around it, a file per part or area (the article's and
the core's tests are test_agent_loop.py, at the project's root).
"""
