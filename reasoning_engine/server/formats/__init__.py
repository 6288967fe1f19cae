"""The chat formats, one module per model family: its markers, tool-call parser, call grammar and reasoning format.
`registry.py` names them for the server's flags and picks them for `auto`."""
