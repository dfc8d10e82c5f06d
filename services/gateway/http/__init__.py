"""The HTTP front end: the OpenAI API (server, request parsing, SSE), tokenization and detokenization."""
