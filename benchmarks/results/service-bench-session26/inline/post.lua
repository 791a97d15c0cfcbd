wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"text": "the film was a moving story with great music and a brilliant ending but the plot felt long the film was a moving story with great music and a brilliant ending but the plot felt long the film was a moving story with great music and a brilliant ending but the plot felt long the film was a moving story with great music and a brilliant ending but the plot felt long"}'
