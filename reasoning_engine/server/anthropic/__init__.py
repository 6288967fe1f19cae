"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A thin translator over the chat path, so Claude Code and Anthropic SDK clients get the same engine, parsers, limits
and metrics as OpenAI clients: a Messages request becomes a `ChatCompletionRequest`, goes through
`OpenAIServing.prepare_chat` -> `EngineRequests` -> `ChatRun.updates()`, and the parsed thinking / text / tool-call
deltas become Anthropic content blocks. Streamed and whole replies are built by the same `_ContentBlocks`, so the
streamed deltas join to the whole reply.

Where the two APIs differ:
- Tool call ids: the reply's `toolu_...` id is the model's own call id (Kimi's `functions.NAME:IDX`), base64url
  encoded, and is decoded again when the client sends it back in `tool_use` / `tool_result`, so the prompt shows the
  model the ids it was trained with; any other id is used as it is.
- `signature` of a thinking block: a SHA-256 of the thinking text, for clients that keep only signed thinking. It
  is not checked: thinking passed back is rendered as it comes, as `reasoning_content` is on the chat route.
- `usage.input_tokens` counts the prompt tokens not read from the prefix cache (`cache_read_input_tokens`), as
  Anthropic counts them; count_tokens gives the whole prompt.
- `max_tokens` past the room left in the context is cut to that room (newer Claude models do the same) and a reply
  that fills it stops with `model_context_window_exceeded`.
- Without `thinking` the chat template's default applies (the bundled model thinks). `budget_tokens` follows
  Anthropic's rules: at least 1024, and below `max_tokens` unless an interleaved-thinking beta is on.
"""
