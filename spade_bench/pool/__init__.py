"""The pool benchmark: the prefix cache's hit rate behind two verifier replicas when the shipped
nginx pool routes by prefix, against by session.

``python -m spade_bench.pool``: ``stack`` starts the replicas, nginx on the shipped config
(``spade_bench.nginx_pool``) and an edge; ``bench`` sends the requests and reports.
"""
