"""The HTTP shell every route stands on: the app factory (`app.create_app`, `settings_of`),
tokens and scopes (`auth`), what stands between a request and a 500 (`guards`) and the
health probes (`health`). It knows no route of its own."""
