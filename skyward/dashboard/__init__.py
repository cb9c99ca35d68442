"""The dashboard: a page of every run and pool, served by ``skyward dashboard``.

`runs` gathers what it shows (the pools' history, the detached runs); `server` serves the
page and its data; ``static/`` is the page. Needs the ``skyward[dashboard]`` extra.
"""
