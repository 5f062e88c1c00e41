/* reference.h - the configuration reference (docs/configuration.md) written from conf's key tables. Never parses YAML.
 */
#ifndef IDEMGATE_CONF_REFERENCE_H
#define IDEMGATE_CONF_REFERENCE_H

/* The whole reference as Markdown (idemgate --print-reference); NULL when it cannot be built. The caller frees
 * it. */
char *conf_reference_markdown(void);

#endif
