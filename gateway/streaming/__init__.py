"""Reading a job's stream and writing it to a client, for the job routes, the OpenAI routes and Responses.

- `ids`: a stream entry, its id, and the one parser and validator of ids (`after`, Last-Event-ID).
- `relay`: the few Redis connections through which every followed stream is read (`StreamRelay`).
- `reading`: one reader's way through a job's stream: where a resumed read starts, which entries to
  send, where it ends, what a quiet spell means.
- `sse`: the framing of an event, keep-alives, and the generator-fed event-stream response.
- `direct`: a body written straight to the connection by the gateway's own HTTP protocol, paced to a
  slow client.
- `job_events`: a job's stream as events (`GET /v1/jobs/{id}/events`, Responses' streams).
- `departure`: noticing that a client left.
- `slots`: the per-key cap on open streams, long-polls and waiting calls.
- `tokens`: signed stream tokens, for a browser's EventSource on a keyed gateway.
"""
