"""The request protocol shared by the HTTP server (hybridinfer.serving.serve) and the batch runner
(hybridinfer.serving.batch):
OpenAI chat/completions and completions bodies and Anthropic messages bodies as pydantic models, the prompts they
make, the parsing of reasoning and tool calls out of the output, and the non-streamed response bodies.

No HTTP here (it imports neither FastAPI nor the server nor the batch runner), so one parser serves both: a batch
line's body is what the server answers to the same request. Needs pydantic (the `serve` or `batch` extra)."""
