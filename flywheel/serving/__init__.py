"""The OpenAI-compatible endpoint agents call: the routes (`routes`: `POST /v1/chat/completions`,
`GET /v1/models`), the request model (`request`), one request through the engine
(`completions`), streaming (`stream`), the production pointer the engine follows
(`sync.ServingSync`, kept for the app's lifetime by `lifespan`) and, beside chat, the
Responses API (`responses_*`).
What each `tool_choice` means is the policy's (`flywheel.policy.tool_choice`)."""
