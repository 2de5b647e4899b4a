"""The node runtime: the scripts a gang runs on its nodes and the parsing of what they write."""
