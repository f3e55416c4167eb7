"""The Gradio web app: thin pieces that turn clicks into calls of :class:`studio.service.Studio` and results into
components. One module per tab (memories, plugins, compare, evaluate, shared), ``plots`` (plotly figures) and
``render`` (HTML/table renderers) are plain functions; ``api`` registers the explicit API endpoints; ``app``
assembles the page."""
