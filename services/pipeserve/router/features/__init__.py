"""Request features, each a self-contained parser/checker the API layer calls: structured outputs,
tools and their output parsers (tool_parsers/), reasoning split, echo's prompt side, a request's
cost. Imports router.errors only."""
