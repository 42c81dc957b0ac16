"""HTTP serving shared by the exporter and the training job's metrics: the server and its web config.

:mod:`~smiquery.httpd.server` is a small HTTP/1.1 server that bad clients cannot starve or stop;
:mod:`~smiquery.httpd.webconfig` reads the exporter-toolkit web-config file (TLS, basic auth) that both endpoints take.
"""
