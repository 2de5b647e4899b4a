"""The gang model: a gang's status, as read from its nodes, and its log text (no I/O here)."""
