"""The OpenAI surface: a request parsed and checked field by field (protocol, chat_args), the
OpenAPI document that describes it (openapi*), and a result formatted as OpenAI's JSON (responses,
chat_output). Imports router.errors and features/ only."""
