"""The OpenAI Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `GET .../input_items`.

A thin translator over the chat path, so every rule of chat requests (template, thinking switch and budget, tools,
media and their 400s, sampling checks) applies unchanged: a Responses request becomes a `ChatCompletionRequest`
(`to_chat_request`), goes through `OpenAIServing.prepare_chat` -> `EngineRequests` -> `ChatRun.updates()`, and the
parsed reasoning / content / tool-call deltas become output items and stream events (`ResponseOutput`). The
non-streaming response is built by the same `ResponseOutput` with its events dropped, so both report the same items.

Stored responses (`store`, default true) are kept in memory (`ResponseStore`: LRU, bounded in count, each entry
expiring a fixed time after it was stored). A stored response keeps the items its prompt was made of plus its output,
so `previous_response_id` prepends exactly the earlier conversation: the new prompt renders as the previous prompt
plus the new turn, and the engine's prefix cache serves the shared part. `instructions` are not carried over (as in
OpenAI's API): each request sends its own.
"""
