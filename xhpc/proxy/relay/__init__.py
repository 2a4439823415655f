"""What passes between a client and an engine: the request's body, the answer's changes (public
names, usage chunks, finished answers), server-sent events, and streams that go on after their
engine died.
"""
