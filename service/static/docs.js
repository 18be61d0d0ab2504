// The API docs page (/docs): Swagger UI from the swagger-ui-bundle package, on the service's
// own OpenAPI schema. A file of its own: the page's Content-Security-Policy allows no inline
// script.
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
